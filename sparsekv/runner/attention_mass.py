"""Attention mass kept for the methods that accumulate it (H2O).

Both paths of ``PagedAttention`` add the mass their rows put on a layer's slots to the layer's
accumulator (``LayerKV.accumulated``); a verifying request also keeps each row's own mass
(``RequestSlice.draft_mass``), so the rows of rejected draft tokens can be taken back out
(``spec_decode.rollback``).
"""

from __future__ import annotations

import torch

from sparsekv.compression.scoring import prefill_attention_mass
from sparsekv.kv_cache.request_kv import LayerKV


def accumulate_mass(state: LayerKV, mass: torch.Tensor) -> None:
    """Add ``[num_kv_heads, num_slots]`` attention mass, growing the accumulator."""
    acc = state.accumulated
    if acc is None:
        state.accumulated = mass.float().clone()
        return
    grown = mass.float().clone()
    grown[:, : acc.shape[1]] += acc
    state.accumulated = grown


def row_masses(
    keys: torch.Tensor,
    queries: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None,
) -> list[torch.Tensor]:
    """Each chunk row's own attention mass (row ``j`` of ``n`` sees the first
    ``len - n + j + 1`` slots): ``n`` tensors ``[num_kv_heads, len - n + j + 1]``."""
    num_rows, num_slots = queries.shape[1], keys.shape[1]
    return [
        prefill_attention_mass(
            keys[:, : num_slots - num_rows + j + 1],
            queries[:, j : j + 1],
            None if lse is None else lse[:, j : j + 1],
            scale,
            logit_softcap,
        )
        for j in range(num_rows)
    ]
