"""Per-slot attention mass of a decode step (H2O): each held slot's probability under the
final softmax, summed over the query heads of its KV group.

Runs after the decode kernels have the final log-sum-exp of every head: the keys are read once
more, ``exp(logit - lse)`` per (head, slot), summed over the group. Same splits as the decode
launch (``decode._decode``), so each program walks one split of one (request, KV head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.attention.triton.common import dot_rows, pool_strides, softcap


@triton.jit
def _mass_kernel(
    q_ptr, stride_qb, stride_qh,
    pool_ptr, stride_page, stride_kv, stride_head, stride_slot,
    scales_ptr, stride_s_page, stride_s_kv, stride_s_head,
    table_ptr, stride_tb, seq_lens_ptr, first_ptr, lse_ptr, mass_ptr, table_slots, split_slots,
    sm_scale, window, cap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, QUANT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    first = tl.load(first_ptr + b).to(tl.int32)
    start = split * split_slots
    end = tl.minimum(start + split_slots, seq_len - first)
    if HAS_WINDOW:
        start = tl.maximum(start, seq_len - window - first)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)
    lse = tl.load(lse_ptr + b * GROUP * num_kv_heads + heads, mask=row_mask, other=float("inf"))
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    head_base = pool_ptr + kv_head.to(tl.int64) * stride_head
    scale_base = scales_ptr + kv_head.to(tl.int64) * stride_s_head
    mass_row = mass_ptr + (b * num_kv_heads + kv_head).to(tl.int64) * table_slots
    tile = start
    while tile < end:  # a while loop: the interpreter cannot range() over loaded bounds
        slots = tile + tl.arange(0, BLOCK_N)
        slot_mask = slots < end
        page = tl.load(table_row + slots // BLOCK_SIZE, mask=slot_mask, other=0).to(tl.int64)
        offset = (slots % BLOCK_SIZE).to(tl.int64)
        k_ptrs = (head_base + page * stride_page + offset * stride_slot)[:, None] + dims[None, :]
        k = tl.load(k_ptrs, mask=slot_mask[:, None] & dim_mask[None, :], other=0)
        if QUANT == 2:
            k = k.to(tl.float8e4nv, bitcast=True)
        logits = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        if QUANT != 0:
            k_scale = tl.load(scale_base + page * stride_s_page + offset, mask=slot_mask, other=0.0)
            logits = logits * k_scale[None, :]
        logits = logits * sm_scale
        if HAS_SOFTCAP:
            logits = softcap(logits, cap)
        p = tl.exp(logits - lse[:, None])
        p = tl.where(row_mask[:, None] & slot_mask[None, :], p, 0.0)
        tl.store(mass_row + slots, tl.sum(p, 0), mask=slot_mask)
        tile += BLOCK_N


def attention_mass(
    query: torch.Tensor,
    pool: torch.Tensor,
    scale_args: tuple,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first_slots: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    window: int,
    cap: float,
    split_slots: int,
    splits: int,
    group: int,
    consts: dict,
) -> torch.Tensor:
    """``[batch, num_kv_heads, max_blocks * block_size]`` fp32 mass of every held slot (zero
    past each request's held count and below its sliding window), from the decode launch's
    ``lse`` ``[batch, num_heads]`` and its tile constants ``consts``."""
    batch = query.shape[0]
    num_kv_heads = pool.shape[2]
    table_slots = block_tables.shape[1] * pool.shape[3]
    mass = torch.zeros((batch, num_kv_heads, table_slots), dtype=torch.float32, device=query.device)
    _mass_kernel[(batch, num_kv_heads, splits)](
        query, query.stride(0), query.stride(1), pool, *pool_strides(pool), *scale_args,
        block_tables, block_tables.stride(0), seq_lens, first_slots, lse, mass, table_slots,
        split_slots, scale, window, cap, GROUP=group, BLOCK_H=dot_rows(group), **consts,
    )  # fmt: skip
    return mass
