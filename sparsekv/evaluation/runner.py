"""Run long-context tasks through the offline engine and score the answers.

The grid is tasks x lengths x (depths x samples) x compression cells; every sample is rendered
with the engine tokenizer's chat template, decoded greedily with ``max_tokens`` = the reference
answer's tokens + a margin, and scored with the task's metric (:mod:`.scoring`, 0-100). All
requests of the grid go through one engine at once (continuous batching keeps the cores busy).

The engine is an argument, so tests run the grid on a tiny random model.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparsekv.config import CompressionConfig
from sparsekv.engine.prompts import encode_prompt
from sparsekv.evaluation.length import answer_prefix_ids
from sparsekv.evaluation.sample import Sample
from sparsekv.evaluation.scoring import score
from sparsekv.evaluation.tasks import RETRIEVAL_TASKS, TASKS, generate
from sparsekv.sampling_params import SamplingParams


@dataclass(frozen=True)
class Cell:
    """One compression setting of the grid (``none`` runs once, at ratio 0)."""

    method: str
    ratio: float
    policy: CompressionConfig


@dataclass(frozen=True)
class Case:
    """One generated sample and its prompt token ids (chat template applied)."""

    sample: Sample
    sample_index: int
    prompt_ids: list[int]

    @property
    def key(self) -> str:
        depth = "" if self.sample.depth is None else f"{self.sample.depth:g}"
        target = self.sample.metadata["target_length"]
        return f"{self.sample.task}|{target}|{depth}|{self.sample_index}"


def build_cells(
    methods: Sequence[str], ratios: Sequence[float], base: CompressionConfig
) -> list[Cell]:
    """``none`` once at ratio 0, every other method at every ratio (window, pooling, full
    layers... from ``base``; the size is the ratio).

    Raises:
        ValueError: an unknown method or a ratio outside [0, 1).
    """
    cells = []
    for method in methods:
        if method == "none":
            cells.append(Cell("none", 0.0, CompressionConfig(method="none")))
            continue
        for ratio in ratios:
            policy = dataclasses.replace(base, method=method, budget=None, compression_ratio=ratio)
            policy.validate()
            cells.append(Cell(method, float(ratio), policy))
    return cells


def default_depths(num_samples: int) -> list[float]:
    """Bin centres of ``num_samples`` equal depth bins: depths spread evenly over 0-100%."""
    return [(index + 0.5) / num_samples for index in range(num_samples)]


def build_cases(
    tokenizer: Any,
    tasks: Sequence[str],
    lengths: Sequence[int],
    num_samples: int,
    depths: Sequence[float] | None = None,
    seed: int = 0,
    prompt_format: str = "chat",
) -> list[Case]:
    """Generate every sample of the grid.

    ``prompt_format`` ``chat`` renders each sample with the chat template and appends its answer
    prefix after the assistant header; ``chat-plain`` is the question as a plain chat user
    message, no answer prefix (the model answers in its own words); ``completion`` gives the user text, a blank line and the
    answer prefix as plain text (base models such as Gemma 3 270M answer only this way).

    Retrieval tasks get ``depths`` x ``num_samples`` samples (a needle grid), or, without
    ``depths``, ``num_samples`` samples at :func:`default_depths`; other tasks get
    ``num_samples`` samples. Seeds differ per sample and depth, so keys and values differ.

    Raises:
        ValueError: an unknown task or prompt format, or a length too short for a task.
    """
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format: {prompt_format!r} is not one of {PROMPT_FORMATS}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"tasks: unknown {unknown}; choose from {sorted(TASKS)}")
    cases = []
    for task in tasks:
        for length in lengths:
            for index, depth, case_seed in _sample_plan(task, num_samples, depths, seed):
                sample = generate(task, tokenizer, length, depth=depth, seed=case_seed)
                ids = sample_prompt_ids(tokenizer, sample, prompt_format)
                cases.append(Case(sample, index, ids))
    return cases


PROMPT_FORMATS = ("chat", "chat-plain", "completion")


def sample_prompt_ids(tokenizer: Any, sample: Sample, prompt_format: str = "chat") -> list[int]:
    """Prompt token ids of ``sample``, ending with its answer prefix (see :func:`build_cases`)."""
    if prompt_format == "completion":
        text = sample.prompt_text + ("\n\n" + sample.answer_prefix if sample.answer_prefix else "")
        return encode_prompt(tokenizer, text)
    if prompt_format == "chat-plain":
        return encode_prompt(tokenizer, sample.messages)
    return encode_prompt(tokenizer, sample.messages) + answer_prefix_ids(
        tokenizer, sample.answer_prefix
    )


def _sample_plan(task: str, num_samples: int, depths: Sequence[float] | None, seed: int):
    """``(sample index, depth, seed)`` of every sample of one task at one length."""
    if task not in RETRIEVAL_TASKS:
        return [(i, None, seed + i) for i in range(num_samples)]
    if depths is None:
        return [(i, d, seed + i) for i, d in enumerate(default_depths(num_samples))]
    return [(i, d, seed + 1000 * k + i) for k, d in enumerate(depths) for i in range(num_samples)]


def max_answer_tokens(sample: Sample, margin: int) -> int:
    """``max_tokens`` of a sample: its reference answer's tokens plus ``margin``."""
    return int(sample.metadata["num_answer_tokens"]) + margin


def run_grid(
    engine, cases: Sequence[Case], cells: Sequence[Cell], margin: int, progress=None
) -> list[dict[str, Any]]:
    """Run every (case, cell) greedily through ``engine`` and score it.

    Args:
        engine: an idle ``LLMEngine`` (its pool is empty again on return).
        cases: samples from :func:`build_cases`.
        cells: compression settings from :func:`build_cells`.
        margin: tokens allowed beyond the reference answer.
        progress: optional tqdm bar advanced by computed tokens.

    Returns:
        One row per (case, cell): task, length (target), num_prompt_tokens, depth, sample,
        method, ratio, score (0-100), compression_ratio (effective, from the engine),
        prediction and answers.

    Raises:
        ValueError: a request the engine refuses (prompt over the context, pool too small).
    """
    from sparsekv.bench.common import BenchRequest, run_requests

    requests, keys = [], {}
    for case in cases:
        params = SamplingParams(max_tokens=max_answer_tokens(case.sample, margin), temperature=0.0)
        for index, cell in enumerate(cells):
            request_id = f"{case.key}|{index}"
            keys[request_id] = (case, cell)
            requests.append(BenchRequest(request_id, case.prompt_ids, params, cell.policy))
    outputs, _ = run_requests(engine, requests, progress=progress)
    rows = []
    for request_id, (case, cell) in keys.items():
        output = outputs[request_id]
        text = output.outputs[0].text
        sample = case.sample
        stats = output.kv_stats
        rows.append(
            {
                "task": sample.task,
                "length": sample.metadata["target_length"],
                "num_prompt_tokens": len(case.prompt_ids),
                "depth": sample.depth,
                "sample": case.sample_index,
                "method": cell.method,
                "ratio": cell.ratio,
                "score": score(sample.metric, text, sample.answers),
                "compression_ratio": stats.compression_ratio if stats else 0.0,
                "prediction": text,
                "answers": " | ".join(sample.answers),
            }
        )
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean score and effective compression ratio per (task, length, method, ratio), in the
    order the groups first appear."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["length"], row["method"], row["ratio"]), []).append(row)
    return [
        {
            "task": task,
            "length": length,
            "method": method,
            "ratio": ratio,
            "score": statistics.fmean(r["score"] for r in group),
            "compression_ratio": statistics.fmean(r["compression_ratio"] for r in group),
            "num_samples": len(group),
        }
        for (task, length, method, ratio), group in groups.items()
    ]
