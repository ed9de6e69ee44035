"""One prefill per sample for every cell of the RULER grid, through the engine's prefix cache.

Every cell of a sample prefills the same prompt; only what happens at the end of the prompt
(query-aware) or of the context (query-agnostic) differs. So the full-cache request of a sample
runs first, its prompt's pages enter the prefix cache, and every compressed request of the
sample attaches them and recomputes only its tail: the observation window and, under the
query-agnostic protocol, the question after the context. Compression then runs on the attached
pages as it would on computed ones (a layer holding shared pages compacts into fresh pages), so
a cell's kept slots and answer are those of a cold run.

Requests run in stages: stage ``i`` holds the full-cache requests of sample group ``i`` first
and the compressed requests of group ``i - 1`` after them, so each stage's decodes run in one
batch while the next group's prompts are prefilled. A prompt enters the cache only if it ran in
one step (sliding-window layers free pages after each step), hence :func:`sharing_config`: a
step budget that holds a group's prompts whole, and a pool that keeps a group's prefixes cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sparsekv.config import EngineConfig

# Prompts per stage whose pages must be cached at once: a group's, and the next group's.
CACHED_GROUPS = 2


def sharing_config(config: EngineConfig, max_prompt: int, max_tokens: int,
                   group: int, requests_per_group: int) -> EngineConfig:  # fmt: skip
    """``config`` adjusted so a group's prompts are prefilled whole and shared.

    Args:
        config: the engine configuration given on the command line.
        max_prompt: longest prompt of the grid (tokens).
        max_tokens: largest ``max_tokens`` of the grid.
        group: samples per stage.
        requests_per_group: requests of one group (full cache and cells) in a stage.

    Returns:
        A copy with prefix caching on, ``max_model_len`` at least ``max_prompt + max_tokens``,
        ``max_num_batched_tokens`` at least ``max_model_len`` and ``group`` prompts plus a
        tail per request, and ``max_num_seqs`` at least the requests of a stage.
    """
    model_len = max(config.model.max_model_len or 0, max_prompt + max_tokens)
    scheduler = config.scheduler
    batched = max(scheduler.max_num_batched_tokens, model_len, group * max_prompt + 8192)
    seqs = max(scheduler.max_num_seqs, group + requests_per_group)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, max_model_len=model_len),
        cache=dataclasses.replace(config.cache, enable_prefix_caching=True),
        scheduler=dataclasses.replace(scheduler, max_num_batched_tokens=batched, max_num_seqs=seqs),
    )


def stages(sharers: Sequence[Any], followers: Sequence[Sequence[Any]],
           group: int) -> list[list[Any]]:  # fmt: skip
    """Order the requests so each sample's sharer is prefilled before its followers arrive.

    Args:
        sharers: one full-cache request per sample.
        followers: per sample, the requests that attach its sharer's prompt pages.
        group: samples per stage (>= 1).

    Returns:
        Stage ``i``: the sharers of samples ``[i * group, (i + 1) * group)``, then the
        followers of the group before; one more stage for the last group's followers.

    Raises:
        ValueError: ``group < 1`` or one list of followers per sample missing.
    """
    if group < 1:
        raise ValueError(f"group: must be >= 1, got {group}")
    if len(sharers) != len(followers):
        raise ValueError(
            f"followers: {len(followers)} lists for {len(sharers)} sharers (one per sample)"
        )
    starts = range(0, len(sharers), group)
    out, previous = [], []
    for start in starts:
        out.append(list(sharers[start : start + group]) + previous)
        previous = [r for cell in followers[start : start + group] for r in cell]
    if previous:
        out.append(previous)
    return out


def run_stages(run: Callable[[list[Any]], dict[str, Any]],
               staged: Sequence[Sequence[Any]]) -> dict[str, Any]:  # fmt: skip
    """Run every stage to completion with ``run`` (one batch per stage) and merge the outputs
    by request id."""
    outputs: dict[str, Any] = {}
    for requests in staged:
        if requests:
            outputs.update(run(list(requests)))
    return outputs
