"""Plain-PyTorch window scores over paged keys: the oracle of the native window-score kernel.

(It belongs beside the other references in ``attention/torch_ref.py``; it lives here until that
file takes it.)
"""

from __future__ import annotations

import torch

from sparsekv.attention.torch_ref import causal_mask, gather_kv


def window_scores_paged(
    window_queries: torch.Tensor,
    lse: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_slots: int,
    scale: float,
) -> torch.Tensor:
    """Attention each held slot receives from the observation window (DESIGN.md §4).

    ``out[h, j] = sum_i exp(q_i . k_j * scale - lse_i)`` over window rows ``i`` that see slot
    ``j``: row ``i`` is the query of slot ``num_slots - window + i`` and sees slots up to it.

    Args:
        window_queries: ``[num_heads, window, head_dim]`` (fp32 or bf16), ``window <= num_slots``.
        lse: ``[num_heads, window]`` fp32 natural-log sum of exp of each row's logits.
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``.
        block_table: ``[num_blocks]`` int64 page ids of the layer, slot 0 first.
        num_slots: held slots.
        scale: softmax scale.

    Returns:
        ``[num_heads, num_slots]`` fp32 scores per query head (not aggregated over a group).
    """
    num_heads, window, _ = window_queries.shape
    num_kv_heads = kv_pool.shape[2]
    keys, _ = gather_kv(kv_pool, block_table, num_slots)  # [kvh, num_slots, d]
    keys = keys.float().repeat_interleave(num_heads // num_kv_heads, dim=0)
    logits = torch.matmul(window_queries.float(), keys.transpose(-1, -2)) * scale
    probs = torch.exp(logits - lse.float()[..., None])  # [num_heads, window, num_slots]
    visible = causal_mask(window, num_slots, device=probs.device)
    return probs.masked_fill(~visible, 0.0).sum(dim=1)
