"""SnapKV window scores over paged keys (Li et al. 2024, "SnapKV: LLM Knows What You are
Looking for Before Generation"): the attention each held slot receives from the observation
window, summed over the window rows.

Semantics of ``cpu.reference.window_scores_paged``: ``out[h, j] = sum_i exp(q_i . k_j * scale
- lse_i)`` over the window rows ``i`` that see slot ``j`` (row ``i`` is the query of slot
``num_slots - window + i``). The LSE of the rows is given (the prefill attention returned it)
or computed first by ``_window_lse_kernel`` over exactly the slots each row sees (decode-time
re-scoring, where no attention ran over them). One program per (query head, tile of slots)
holds the head's whole window (``window`` rows padded to a ``tl.dot`` tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.attention.triton.common import check_device, dot_rows, pool_strides
from sparsekv.attention.triton.decode import dot_dtype

BLOCK_N = 32


@triton.jit
def _window_logits(
    q, table_row, head_base, tile, num_slots, num_window, dims, dim_mask, windows_rows,
    sm_scale, stride_page, stride_slot, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Logits ``[BLOCK_W, BLOCK_N]`` of the window rows over one tile of held slots, ``-inf``
    where a row does not see the slot (or either is padding)."""
    slots = tile + tl.arange(0, BLOCK_N)
    slot_mask = slots < num_slots
    page = tl.load(table_row + slots // BLOCK_SIZE, mask=slot_mask, other=0).to(tl.int64)
    offset = (slots % BLOCK_SIZE).to(tl.int64)
    k_ptrs = (head_base + page * stride_page + offset * stride_slot)[:, None] + dims[None, :]
    k = tl.load(k_ptrs, mask=slot_mask[:, None] & dim_mask[None, :], other=0.0)
    logits = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * sm_scale
    last_seen = num_slots - num_window + windows_rows  # row i sees slots up to this one
    visible = (slots[None, :] <= last_seen[:, None]) & (windows_rows < num_window)[:, None]
    return tl.where(visible & slot_mask[None, :], logits, float("-inf")), slots, slot_mask


@triton.jit
def _window_lse_kernel(
    q_ptr, stride_qh, stride_qw, pool_ptr, stride_page, stride_head, stride_slot, table_ptr,
    lse_ptr, num_slots, num_window, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    rows = tl.arange(0, BLOCK_W)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + head * stride_qh + rows[:, None] * stride_qw + dims[None, :]
    q_mask = (rows < num_window)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(DOT_DTYPE)
    head_base = pool_ptr + (head // GROUP).to(tl.int64) * stride_head
    m_i = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_W], tl.float32)
    tile = num_slots * 0
    while tile < num_slots:
        logits, _, _ = _window_logits(
            q, table_ptr, head_base, tile, num_slots, num_window, dims, dim_mask, rows,
            sm_scale, stride_page, stride_slot, BLOCK_SIZE, BLOCK_N, DOT_DTYPE,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - safe_m) + tl.sum(tl.exp(logits - safe_m[:, None]), 1)
        m_i = m_new
        tile += BLOCK_N
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + head * num_window + rows, lse, mask=rows < num_window)


@triton.jit
def _window_scores_kernel(
    q_ptr, stride_qh, stride_qw, lse_ptr, stride_lh, pool_ptr, stride_page, stride_head,
    stride_slot, table_ptr, out_ptr, num_slots, num_window, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    rows = tl.arange(0, BLOCK_W)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + head * stride_qh + rows[:, None] * stride_qw + dims[None, :]
    q_mask = (rows < num_window)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(DOT_DTYPE)
    lse = tl.load(lse_ptr + head * stride_lh + rows, mask=rows < num_window, other=float("inf"))
    head_base = pool_ptr + (head // GROUP).to(tl.int64) * stride_head
    logits, slots, slot_mask = _window_logits(
        q, table_ptr, head_base, tl.program_id(1) * BLOCK_N, num_slots, num_window, dims,
        dim_mask, rows, sm_scale, stride_page, stride_slot, BLOCK_SIZE, BLOCK_N, DOT_DTYPE,
    )  # fmt: skip
    scores = tl.sum(tl.exp(logits - lse.to(tl.float32)[:, None]), 0)
    tl.store(out_ptr + head.to(tl.int64) * num_slots + slots, scores, mask=slot_mask)


def window_scores_paged(
    window_queries: torch.Tensor,
    lse: torch.Tensor | None,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_slots: int,
    scale: float,
) -> torch.Tensor:
    """Window scores over paged keys; arguments and result as
    ``cpu.reference.window_scores_paged``.

    Args:
        window_queries: ``[num_heads, window, head_dim]`` fp32, bf16 or fp16,
            ``window <= num_slots``.
        lse: ``[num_heads, window]`` fp32 LSE of each row over the slots it sees, or ``None``
            to compute it here.
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``, unit last stride.
        block_table: ``[num_blocks]`` int page ids of the layer, slot 0 first.
        num_slots: held slots.
        scale: softmax scale.

    Returns:
        ``[num_heads, num_slots]`` fp32 (per query head, not aggregated over a group).

    Raises:
        ValueError: a window longer than the held slots, mismatched heads, or devices.
    """
    num_heads, num_window, head_dim = window_queries.shape
    num_kv_heads, block_size = kv_pool.shape[2], kv_pool.shape[3]
    if num_window > num_slots or num_heads % num_kv_heads or kv_pool.shape[4] != head_dim:
        raise ValueError(
            f"window_queries {tuple(window_queries.shape)} do not fit {num_slots} held slots "
            f"of a pool {tuple(kv_pool.shape)}"
        )
    check_device(window_queries, kv_pool, block_table)
    out = torch.zeros((num_heads, num_slots), dtype=torch.float32, device=kv_pool.device)
    if num_slots == 0 or num_window == 0:
        return out
    queries = window_queries if window_queries.stride(-1) == 1 else window_queries.contiguous()
    stride_page, _, stride_head, stride_slot = pool_strides(kv_pool)
    table = block_table.contiguous()
    consts = dict(
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_W=dot_rows(num_window),
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, DOT_DTYPE=dot_dtype(queries, kv_pool.dtype),
    )  # fmt: skip
    pool_args = (kv_pool, stride_page, stride_head, stride_slot, table)
    if lse is None:
        lse = torch.empty((num_heads, num_window), dtype=torch.float32, device=kv_pool.device)
        _window_lse_kernel[(num_heads,)](
            queries, queries.stride(0), queries.stride(1), *pool_args, lse, num_slots,
            num_window, float(scale), **consts,
        )  # fmt: skip
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    _window_scores_kernel[(num_heads, triton.cdiv(num_slots, BLOCK_N))](
        queries, queries.stride(0), queries.stride(1), lse, lse.stride(0), *pool_args, out,
        num_slots, num_window, float(scale), **consts,
    )  # fmt: skip
    return out
