"""``sparsekv eval --suite ruler``: the official RULER tasks through the offline engine.

Samples come from the package's generators (:mod:`.ruler_tasks`); every sample runs greedily
for every compression cell, with ``max_tokens`` = the task's ``tokens_to_generate``, under two
protocols (kvpress's):

* ``aware``: the whole prompt is compressed, the question inside the observation window;
* ``agnostic``: only the context is compressed (``kv_compression.scope = "context"``,
  ``context_tokens`` = the context's tokens), the question is prefilled after it, uncompressed.

The full cache (method ``none``) is the same under both protocols and runs once. Prompt tokens
are the context's and the question's encoded apart and joined, so both protocols see the same
ids and the context boundary is a token boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparsekv.config import CompressionConfig
from sparsekv.evaluation import ruler_share, ruler_tasks
from sparsekv.evaluation.runner import Cell
from sparsekv.evaluation.scoring import score
from sparsekv.sampling_params import SamplingParams

PROTOCOLS = ("aware", "agnostic")


@dataclass(frozen=True)
class RulerCase:
    """One sample and its prompt ids (``context_tokens`` of them are the context)."""

    sample: ruler_tasks.RulerSample
    metric: str
    target_length: int
    prompt_ids: list[int]
    context_tokens: int
    max_tokens: int


def prompt_ids(tokenizer: Any, sample: ruler_tasks.RulerSample,
               prompt_format: str) -> tuple[list[int], int]:  # fmt: skip
    """``(ids, context_tokens)`` of a sample.

    ``completion``: the package's input text as it is (RULER's ``base`` template), the context
    encoded with the tokenizer's specials (BOS), the question and answer prefix without.
    ``chat``: the context and question as the user message of the chat template, the answer
    prefix (its leading space dropped) after the assistant header; ``chat-plain``: the same
    without the answer prefix.

    Raises:
        ValueError: an unknown format, or a chat template that rewrites the question text.
    """
    if prompt_format == "completion":
        context = list(tokenizer(sample.context)["input_ids"])
        rest = tokenizer.encode(sample.question + sample.answer_prefix, add_special_tokens=False)
        return context + list(rest), len(context)
    if prompt_format not in ("chat", "chat-plain"):
        raise ValueError(
            f"prompt_format: {prompt_format!r} is not one of chat, chat-plain, completion"
        )
    messages = [{"role": "user", "content": sample.context + sample.question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    split = text.rfind(sample.question)
    if split < 0:
        raise ValueError("prompt_format chat: the chat template rewrote the question")
    context = tokenizer.encode(text[:split], add_special_tokens=False)
    prefix = sample.answer_prefix.lstrip() if prompt_format == "chat" else ""
    rest = tokenizer.encode(text[split:] + prefix, add_special_tokens=False)
    return list(context) + list(rest), len(context)


def build_cases(tokenizer: Any, task_names: Sequence[str], lengths: Sequence[int],
                num_samples: int, seed: int, prompt_format: str) -> list[RulerCase]:  # fmt: skip
    """Generate every task's samples at every length (the script's ``--random_seed`` is
    ``42 + seed``: ``seed = 0`` gives the package's own single-chunk samples).

    Raises:
        ValueError: an unknown task name.
    """
    tasks = ruler_tasks.load_tasks()
    unknown = [name for name in task_names if name not in tasks]
    if unknown:
        raise ValueError(f"tasks: unknown RULER tasks {unknown}; choose from {list(tasks)}")
    cases = []
    for name in task_names:
        task = tasks[name]
        for length in lengths:
            for sample in ruler_tasks.generate(task, tokenizer, length, num_samples, 42 + seed):
                ids, num_context = prompt_ids(tokenizer, sample, prompt_format)
                cases.append(
                    RulerCase(
                        sample, task.metric, length, ids, num_context, task.tokens_to_generate
                    )  # fmt: skip
                )
    return cases


def interleave(cases: Sequence[RulerCase]) -> list[RulerCase]:
    """The cases ordered sample index first (sample 0 of every task and length, then sample
    1...), so a run stopped early has results for every task."""
    return sorted(cases, key=lambda case: case.sample.index)


def policy_of(cell: Cell, case: RulerCase, protocol: str) -> CompressionConfig:
    """The cell's policy under ``protocol`` for this case.

    Raises:
        ValueError: an unknown protocol.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol: {protocol!r} is not one of {PROTOCOLS}")
    if protocol == "aware" or cell.method == "none":
        return cell.policy
    return dataclasses.replace(cell.policy, scope="context", context_tokens=case.context_tokens)


def run(engine, cases: Sequence[RulerCase], cells: Sequence[Cell], protocols: Sequence[str],
        progress=None, share_group: int = 0, on_rows=None) -> list[dict[str, Any]]:  # fmt: skip
    """Run every (case, cell, protocol) greedily and score it as RULER does.

    The full cache runs once per case; its row is repeated under each protocol.

    Args:
        engine: an idle engine; with ``share_group`` its prefix cache must be on and a prompt
            must fit one step (:func:`.ruler_share.sharing_config`).
        cases, cells, protocols: the grid.
        progress: optional tqdm bar advanced by computed tokens.
        share_group: ``0`` runs every request at once, each prefilling its own prompt; ``g > 0``
            shares one prefill per case between its cells, ``g`` cases a stage
            (:mod:`.ruler_share`).
        on_rows: called with the rows of each stage as it finishes (partial results).

    Returns:
        One row per (case, cell, protocol): task, length, protocol, sample, method, ratio,
        score (0-100), compression_ratio (effective), kv_tokens_kept (slots held at the end,
        averaged over layers: compression and sliding windows), num_prompt_tokens,
        context_tokens, prediction, answers.
    """
    from sparsekv.bench.common import run_requests

    sharers, followers, keys = grid_requests(cases, cells, protocols)
    if share_group:
        staged = ruler_share.stages(sharers, followers, share_group)
    else:
        staged = [sharers + [r for cell in followers for r in cell]]
    order = {request_id: index for index, request_id in enumerate(keys)}
    ranked = []
    for requests in staged:
        outputs, _ = run_requests(engine, requests, progress=progress)
        stage_rows = []
        for request_id, output in outputs.items():
            if request_id in keys:
                for row in _rows(keys[request_id], output, protocols):
                    ranked.append((order[request_id], protocols.index(row["protocol"]), row))
                    stage_rows.append(row)
        if on_rows is not None:
            on_rows(stage_rows)
    return [row for _, _, row in sorted(ranked, key=lambda item: item[:2])]


def grid_requests(cases: Sequence[RulerCase], cells: Sequence[Cell], protocols: Sequence[str]):
    """The grid's requests: per case a full-cache *sharer* (the ``none`` cell's, or a
    one-token prefill when the grid has no full cache) and its *followers* (every other
    (cell, protocol)).

    Returns:
        ``(sharers, followers per case, {request id: (case, cell, protocol)})``; the
        one-token sharers have no key (they are not scored).
    """
    from sparsekv.bench.common import BenchRequest

    sharers, followers, keys = [], [], {}
    for index, case in enumerate(cases):
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0.0)
        prefix = f"{case.sample.task}|{case.target_length}|{index}"
        sharer, mine = None, []
        for cell_index, cell in enumerate(cells):
            for protocol in PROTOCOLS[:1] if cell.method == "none" else protocols:
                request_id = f"{prefix}|{cell_index}|{protocol}"
                keys[request_id] = (case, cell, protocol)
                policy = policy_of(cell, case, protocol)
                request = BenchRequest(request_id, case.prompt_ids, params, policy)
                if cell.method == "none" and sharer is None:
                    sharer = request
                else:
                    mine.append(request)
        if sharer is None:
            one = SamplingParams(max_tokens=1, temperature=0.0)
            sharer = BenchRequest(
                f"{prefix}|share", case.prompt_ids, one, CompressionConfig("none")
            )
        sharers.append(sharer)
        followers.append(mine)
    return sharers, followers, keys


def _rows(key, output, protocols: Sequence[str]) -> list[dict[str, Any]]:
    """The scored rows of one finished request (the full cache's, once per protocol)."""
    case, cell, protocol = key
    text = output.outputs[0].text
    stats = output.kv_stats
    row = {
        "task": case.sample.task,
        "length": case.target_length,
        "protocol": protocol,
        "sample": case.sample.index,
        "method": cell.method,
        "ratio": cell.ratio,
        "score": score(case.metric, text, case.sample.answers),
        "compression_ratio": stats.compression_ratio if stats else 0.0,
        "kv_tokens_kept": round(stats.tokens_kept, 2) if stats else 0.0,
        "num_prompt_tokens": len(case.prompt_ids),
        "context_tokens": case.context_tokens,
        "prediction": text,
        "answers": " | ".join(case.sample.answers),
    }
    repeats = protocols if cell.method == "none" else [protocol]
    return [{**row, "protocol": p} for p in repeats]
