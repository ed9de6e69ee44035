"""Roll a verification step's rejected draft tokens out of a request's KV state.

A verifying request computes its last token and ``k`` drafts as one chunk of ``k + 1``
positions: every layer writes ``k + 1`` K/V slots, budgeted layers append ``k + 1`` queries to
their observation window and H2O layers add ``k + 1`` rows of attention mass. When only the
first ``num_kept`` positions are kept (the accepted drafts and the token before them), the
rollback runs after the forward and before the step commits:

- each layer's ``LayerStep.num_new`` becomes ``num_kept``, so the commit sets ``num_slots`` to
  the kept count, frees the pages only rejected slots used and places a sliding layer's window
  by the kept count (the rejected slots' K/V stay behind in the last page, past ``num_slots``,
  and are overwritten by the next write);
- the stored window queries become the window before the step followed by the kept rows;
- H2O accumulators become the accumulator before the step plus the kept rows' mass.

A verification step never compacts (the scheduler drafts only where no layer would compact,
``spec_decode.drafting``), so no compaction ever saw a rejected token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.request_kv import RequestKV


@dataclass
class KVSideState:
    """A verifying request's per-layer side state before its step (``None`` where a layer
    keeps none).

    Attributes:
        queries: per layer, the observation window ``[num_heads, <= window, head_dim]``.
        accumulated: per layer, H2O's ``[num_kv_heads, num_held]`` fp32 attention mass.
    """

    queries: list[torch.Tensor | None]
    accumulated: list[torch.Tensor | None]


def side_state(kv: RequestKV) -> KVSideState:
    """Capture the side state a rollback restores (references: the step replaces the layers'
    tensors, it never writes into them)."""
    budgeted = [state.budget is not None for state in kv.layers]
    return KVSideState(
        queries=[s.recent_queries if b else None for s, b in zip(kv.layers, budgeted)],
        accumulated=[s.accumulated if b else None for s, b in zip(kv.layers, budgeted)],
    )


def roll_back(
    kv: RequestKV,
    steps: list[LayerStep],
    before: KVSideState,
    num_kept: int,
    window: int,
    mass_rows: dict[int, list[torch.Tensor]] | None = None,
) -> None:
    """Keep only the first ``num_kept`` positions of a verification chunk (before commit).

    Args:
        kv: the request's KV state after the forward.
        steps: the step's per-layer plans (their ``num_new`` is set to ``num_kept``).
        before: the side state captured before the forward.
        num_kept: positions kept (``1 .. num_new``).
        window: the request's observation window (the chunk is at most this long).
        mass_rows: per H2O layer, each chunk row's ``[num_kv_heads, num_held + row + 1]``
            attention mass (``PagedAttention`` records them for verifying requests).
    """
    num_new = steps[0].num_new
    assert 1 <= num_kept <= num_new
    if num_kept == num_new:
        return
    for layer, (state, step) in enumerate(zip(kv.layers, steps)):
        step.num_new = num_kept
        if state.budget is None:
            continue
        chunk = state.recent_queries[:, -num_new:]  # [num_heads, num_new, head_dim]
        assert chunk.shape[1] == num_new, "a verification chunk is longer than the window"
        state.recent_queries = _window(before.queries[layer], chunk[:, :num_kept], window)
        if mass_rows is not None and layer in mass_rows:
            state.accumulated = _kept_mass(
                before.accumulated[layer], mass_rows[layer][:num_kept], step.num_held + num_kept
            )


def _window(old: torch.Tensor | None, kept: torch.Tensor, window: int) -> torch.Tensor:
    """The last ``window`` rows of ``old`` followed by ``kept`` (``[num_heads, n, head_dim]``)."""
    rows = kept if old is None else torch.cat([old, kept], dim=1)
    return rows[:, -window:].contiguous()


def _kept_mass(old: torch.Tensor | None, rows: list[torch.Tensor], num_slots: int) -> torch.Tensor:
    """``old`` (``[num_kv_heads, <= num_slots]``) plus each kept row's mass, over
    ``num_slots`` slots (fp32)."""
    num_kv_heads = rows[0].shape[0]
    total = torch.zeros(num_kv_heads, num_slots, dtype=torch.float32, device=rows[0].device)
    if old is not None:
        total[:, : old.shape[1]] += old
    for mass in rows:
        total[:, : mass.shape[1]] += mass.float()
    return total
