"""Shared mechanics of the offline benchmark commands.

Build one engine around a checkpoint, submit a workload all at once, step it to the end while
sampling the pool after every step, and write reports with provenance (benchmarks are
commands with reports, never timed tests). Every command takes an optional
``checkpoint`` so tests can run it end to end on a tiny random model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsekv.config import CompressionConfig, EngineConfig
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.engine.request import Request
from sparsekv.evaluation.provenance import provenance
from sparsekv.evaluation.report import markdown_table
from sparsekv.outputs import RequestOutput
from sparsekv.sampling_params import SamplingParams


@dataclass
class BenchRequest:
    """One request of a workload (arguments of ``LLMEngine.add_request``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    compression: CompressionConfig | dict | None = None
    forced_token_ids: list[int] | None = None
    collect_logits: bool = False


@dataclass
class StepTrace:
    """What the pool and scheduler did during one workload, sampled after every step.

    Attributes:
        num_steps: engine steps run.
        wall_s: seconds from the first ``add_request`` to the last finished request.
        peak_pages_used: most pages held at once (all layers).
        pages_total: pool size in pages.
        peak_running: most requests running at once (``scheduler.num_running``).
        num_preemptions: preemptions during the workload.
        ratio_samples: engine-wide effective compression ratio after each step (``1 - held slots / (layers x tokens)``).
    """

    num_steps: int = 0
    wall_s: float = 0.0
    peak_pages_used: int = 0
    pages_total: int = 0
    peak_running: int = 0
    num_preemptions: int = 0
    ratio_samples: list[float] = field(default_factory=list)

    @property
    def peak_compression_ratio(self) -> float:
        return max(self.ratio_samples, default=0.0)


# --------------------------------------------------------------------------- engine
def resolved_dtype(config: EngineConfig):
    """The torch dtype ``--dtype`` resolves to on this machine (``auto``: fp32 without AMX)."""
    from sparsekv.engine.engine_setup import resolve_dtype

    return resolve_dtype(config.model.dtype, config.model.device)


def load_checkpoint(config: EngineConfig, checkpoint=None):
    """Return ``checkpoint`` if given (tests), else load ``config.model.model`` in its dtype."""
    if checkpoint is not None:
        return checkpoint
    from sparsekv.loader import load_checkpoint as load

    return load(
        config.model.model,
        resolved_dtype(config),
        tokenizer=config.model.tokenizer,
        weight_dtype=config.model.weight_dtype,
    )


def build_engine(config: EngineConfig, checkpoint) -> LLMEngine:
    """An engine over ``checkpoint``'s weights (the model is built once per engine)."""
    from sparsekv.engine.engine_setup import build_engine_parts

    return LLMEngine(config, build_engine_parts(config, checkpoint))


def warm_up(engine: LLMEngine, vocab_size: int) -> None:
    """Run one short request so lazy kernel loading and first-call costs stay out of timings."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, 32, vocab_size, seed=12345)[0]
    run_requests(engine, [BenchRequest("warmup", prompt, params, {"method": "none"})])


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int = 0, avoid: Sequence[int] = ()
) -> list[list[int]]:
    """``num_prompts`` prompts of exactly ``input_len`` uniform random token ids.

    Args:
        num_prompts: prompts wanted.
        input_len: tokens per prompt.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        seed: fixed seed, so every run (and the HF baseline) sees the same workload.
        avoid: ids never drawn (special tokens such as EOS or chat markers).
    """
    banned = set(avoid)
    allowed = [t for t in range(vocab_size) if t not in banned]
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num_prompts)]


def special_token_ids(tokenizer) -> list[int]:
    """The tokenizer's special token ids (empty when it has none)."""
    return list(getattr(tokenizer, "all_special_ids", []) or [])


def run_requests(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    on_finish: Callable[[RequestOutput, Request], None] | None = None,
    progress=None,
) -> tuple[dict[str, RequestOutput], StepTrace]:
    """Add every request at once, step until all finish, and sample the pool after each step.

    Args:
        engine: an idle engine (its pool is empty again on return).
        requests: the workload.
        on_finish: called with each finished output and its scheduler ``Request`` (whose
            ``logits`` hold the collected fp32 ``[vocab_size]`` tensors, one per position).
        progress: an optional tqdm bar advanced by computed tokens (prompt + output).

    Returns:
        ``(outputs by request id, trace)``.

    Raises:
        ValueError: a request the engine refuses at arrival (nothing stays queued then).
        RuntimeError: a request failed inside the engine.
    """
    trace = StepTrace(pages_total=engine.kv.num_total_pages)
    preemptions_before = engine.stats.num_preemptions
    tracked: dict[str, Request] = {}
    start = time.perf_counter()
    try:
        for item in requests:
            engine.add_request(
                item.request_id,
                item.prompt_token_ids,
                item.params,
                item.compression,
                forced_token_ids=item.forced_token_ids,
                collect_logits=item.collect_logits,
            )
            tracked[item.request_id] = engine.scheduler.waiting[-1]
    except ValueError:
        for request_id in tracked:
            engine.abort_request(request_id)
        raise
    finished: dict[str, RequestOutput] = {}
    done_tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        trace.num_steps += 1
        usage = engine.kv_usage()
        trace.peak_pages_used = max(trace.peak_pages_used, int(usage["pages_used"]))
        trace.peak_running = max(trace.peak_running, engine.scheduler.num_running)
        trace.ratio_samples.append(float(usage["compression_ratio"]))
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            if output.finished:
                finished[output.request_id] = output
                if on_finish is not None:
                    on_finish(output, tracked[output.request_id])
        if progress is not None:
            now_tokens = sum(_num_done_tokens(r) for r in tracked.values())
            progress.update(max(0, now_tokens - done_tokens))
            done_tokens = max(done_tokens, now_tokens)
    trace.wall_s = time.perf_counter() - start
    trace.num_preemptions = engine.stats.num_preemptions - preemptions_before
    return finished, trace


def _num_done_tokens(request: Request) -> int:
    if request.finish_reason is not None:
        return len(request.prompt_token_ids) + len(request.output_token_ids)
    return request.num_computed_tokens


def ttft_s(output: RequestOutput) -> float:
    """Time to first token of a finished request: first token - arrival, in seconds."""
    return output.metrics["first_token"] - output.metrics["arrival"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; ``nan`` for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# --------------------------------------------------------------------------- reports
def add_common_args(parser: argparse.ArgumentParser, default_output: str) -> None:
    """``--output PATH.json`` (Markdown and PNG go beside it, same stem) and ``--threads``."""
    parser.add_argument(
        "--output", default=default_output, help=f"report JSON path (default: {default_output})"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own); on a loaded machine 1 thread can "
        "beat 2, whose barrier waits stall while the other core is busy",
    )
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar (ETA)")


def progress_bar(requests: Sequence[BenchRequest], desc: str, disable: bool):
    """A tqdm bar over the tokens ``requests`` will compute (prompt + output), for an ETA."""
    from tqdm import tqdm

    total = sum(len(r.prompt_token_ids) + r.params.max_tokens for r in requests)
    return tqdm(total=total, unit="tok", unit_scale=True, desc=desc, disable=disable)


def apply_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count for this process when ``threads`` is given.

    Raises:
        ValueError: ``threads < 1``.
    """
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (other jobs on the machine skew timings)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def bench_provenance(
    config: EngineConfig, settings: dict[str, Any], load_start: list[float] | None
) -> dict[str, Any]:
    """``evaluation.provenance`` of the engine config and bench settings, plus load averages
    at the start and end of the run."""
    document = provenance({"engine": dataclasses.asdict(config), "bench": settings})
    document["dtype_resolved"] = str(resolved_dtype(config)).removeprefix("torch.")
    document["load_average_start"] = load_start
    document["load_average_end"] = load_average()
    return document


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    """Write ``document`` as indented JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path


def write_markdown(
    path: str | Path, title: str, rows: Sequence[dict], facts: dict[str, Any]
) -> Path:
    """A Markdown table of ``rows`` followed by provenance facts."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(f"- {k}: `{json.dumps(v, default=str)}`" for k, v in facts.items())
    path.write_text(f"# {title}\n\n{markdown_table(rows)}\n\n## Provenance\n\n{lines}\n")
    return path


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A fixed-width text table of ``columns`` (floats to 4 significant digits)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    header = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    body = ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in cells]
    return "\n".join([header, "-" * len(header), *body])


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median over the rounds of ``ours[i] / theirs[i]``: runs of one round are seconds apart,
    so their ratio carries less of the machine's drift than the ratio of the two medians.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired_ratio: {len(ours)} and {len(theirs)} samples do not pair")
    return statistics.median(a / b for a, b in zip(ours, theirs))
