"""Paged decode attention in Triton: one query token per request over its pages.

Semantics of ``torch_ref.paged_decode_attention`` (int8 / fp8 pages: of the same over
the dequantized pool). The work is split as in FlashDecoding (Dao et al. 2023)
and vLLM's / SGLang's Triton decode kernels:

1. ``_decode_partial_kernel``, one program per (request, KV head, split of the table): the
   ``group`` query heads of the KV head are packed into the rows of one ``tl.dot`` tile, so a
   key tile is read once per group; the split's slots are walked in tiles of ``BLOCK_N`` held
   slots (any tile crosses pages: each slot looks up its page in the block table); an online
   softmax in fp32 gives the split's normalised output and log-sum-exp;
2. ``decode_splits.merge_kernel``, one program per request: partials merged by their LSE;
3. with ``return_attn_mass``, ``decode_mass.attention_mass`` re-reads the keys once to turn
   the final LSE into each slot's probability summed over the group (H2O).

The number of splits comes from the table width (``block_tables.shape[1]``) and the device,
never from the lengths, so a launch needs no host sync and suits graph capture. A request
that sees no slot (a padding row: ``seq_lens == first_slots``) gets a zero output and
``lse = -inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.attention.triton.common import (
    check_device,
    dot_rows,
    pool_strides,
    softcap,
)
from sparsekv.attention.triton.decode_mass import attention_mass
from sparsekv.attention.triton.decode_splits import merge_kernel, num_kv_splits

# Launch settings, module attributes so that the GPU benchmark can sweep them
# (``scripts/gpu_bench_decode.py``); the interpreter ignores the warp count.
BLOCK_N = 32  # held slots per tile
NUM_WARPS = 4
QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2


@triton.jit
def _decode_partial_kernel(
    q_ptr, stride_qb, stride_qh,
    pool_ptr, stride_page, stride_kv, stride_head, stride_slot,
    scales_ptr, stride_s_page, stride_s_kv, stride_s_head,
    table_ptr, stride_tb, seq_lens_ptr, first_ptr,
    part_out_ptr, part_lse_ptr, num_splits, split_slots,
    out_ptr, stride_ob, stride_oh, lse_ptr, sm_scale, window, cap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, QUANT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    first = tl.load(first_ptr + b).to(tl.int32)
    start = split * split_slots
    end = tl.minimum(start + split_slots, seq_len - first)
    if HAS_WINDOW:  # held slot j is visible when first + j > seq_len - 1 - window
        start = tl.maximum(start, seq_len - window - first)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    head_base = pool_ptr + kv_head.to(tl.int64) * stride_head
    scale_base = scales_ptr + kv_head.to(tl.int64) * stride_s_head
    tile = start
    while tile < end:  # a while loop: the interpreter cannot range() over loaded bounds
        slots = tile + tl.arange(0, BLOCK_N)
        slot_mask = slots < end
        page = tl.load(table_row + slots // BLOCK_SIZE, mask=slot_mask, other=0).to(tl.int64)
        offset = (slots % BLOCK_SIZE).to(tl.int64)
        k_ptrs = (head_base + page * stride_page + offset * stride_slot)[:, None] + dims[None, :]
        kv_mask = slot_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0)
        v = tl.load(k_ptrs + stride_kv, mask=kv_mask, other=0)
        if QUANT == 2:  # fp8 codes travel as their uint8 bit patterns
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        logits = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        if QUANT != 0:
            s_ptrs = scale_base + page * stride_s_page + offset
            logits = logits * tl.load(s_ptrs, mask=slot_mask, other=0.0)[None, :]
        logits = logits * sm_scale
        if HAS_SOFTCAP:
            logits = softcap(logits, cap)
        logits = tl.where(slot_mask[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT != 0:
            p = p * tl.load(s_ptrs + stride_s_kv, mask=slot_mask, other=0.0)[None, :]
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        tile += BLOCK_N

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if DIRECT:  # one split: the final result
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(lse_ptr + b * GROUP * tl.num_programs(1) + heads, lse, mask=row_mask)
    else:
        part = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * num_splits + split
        tl.store(part_lse_ptr + part, lse, mask=row_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)


def dot_config(query: torch.Tensor, pool_dtype: torch.dtype) -> dict:
    """``DOT_DTYPE``, the dtype both dot operands are cast to (the query's 16-bit dtype when
    the pages hold it, or int8 / fp8 codes, exact in it; else fp32), and ``DOT_PRECISION``
    (``ieee`` for fp32 operands: never TF32; the default, tensor cores, for 16-bit ones)."""
    if query.dtype in (torch.bfloat16, torch.float16) and pool_dtype in (
        query.dtype,
        torch.int8,
        torch.uint8,
    ):
        dtype = tl.bfloat16 if query.dtype == torch.bfloat16 else tl.float16
        return {"DOT_DTYPE": dtype, "DOT_PRECISION": "tf32"}
    return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}


def paged_decode_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    return_attn_mass: bool = False,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Paged decode attention; arguments, shapes and results as
    ``torch_ref.paged_decode_attention``.

    Args:
        query: ``[batch, num_heads, head_dim]`` fp32, bf16 or fp16.
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``, unit last stride.
        block_tables: ``[batch, max_blocks]`` int page ids (padding entries: any valid id).
        seq_lens: ``[batch]`` int logical slot counts (new token included).
        scale: softmax scale.
        first_slots: ``[batch]`` logical slot of each first held page (default 0).
        sliding_window: optional window in slots.
        logit_softcap: optional tanh soft-cap of the logits.
        return_attn_mass: also return each held slot's probability summed over its group.
        num_splits: splits of the table (default :func:`num_kv_splits`; tests force more).

    Returns:
        out ``[batch, num_heads, head_dim]`` (query dtype), lse ``[batch, num_heads]`` fp32,
        mass ``[batch, num_kv_heads, max_blocks * block_size]`` fp32 or ``None``.

    Raises:
        ValueError: mismatched head counts, head_dim, or devices.
    """
    return _decode(
        query, kv_pool, None, QUANT_NONE, block_tables, seq_lens, scale, first_slots,
        sliding_window, logit_softcap, return_attn_mass, num_splits,
    )  # fmt: skip


def paged_decode_attention_quantized(
    query: torch.Tensor,
    kv_data: torch.Tensor,
    kv_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    return_attn_mass: bool = False,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode attention reading int8 or fp8 (e4m3) pages in place: the attention of
    :func:`paged_decode_attention` over the dequantized pool (``code * scale``,
    ``kv_cache.quant``).
    A slot's logit is ``q . k_codes * k_scale`` and its value row enters with weight
    ``p * v_scale``; 16-bit queries multiply the codes in their own dtype (exact for both
    formats).

    Args:
        kv_data: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` int8 or
            float8_e4m3fn codes.
        kv_scales: ``[num_pages, 2, num_kv_heads, block_size]`` fp32, one per slot.
        others: as :func:`paged_decode_attention`.

    Raises:
        ValueError: codes of another dtype, scales of another shape, or as
            :func:`paged_decode_attention`.
    """
    if kv_data.dtype == torch.int8:
        quant = QUANT_INT8
    elif kv_data.dtype == torch.float8_e4m3fn:
        quant, kv_data = QUANT_FP8, kv_data.view(torch.uint8)
    else:
        raise ValueError(f"kv_data must be int8 or float8_e4m3fn, got {kv_data.dtype}")
    if kv_scales.shape != kv_data.shape[:4] or kv_scales.stride(-1) != 1:
        raise ValueError(
            f"kv_scales must be {tuple(kv_data.shape[:4])} with unit last stride, "
            f"got {tuple(kv_scales.shape)}"
        )
    return _decode(
        query, kv_data, kv_scales, quant, block_tables, seq_lens, scale, first_slots,
        sliding_window, logit_softcap, return_attn_mass, num_splits,
    )  # fmt: skip


def _decode(
    query, pool, scales, quant, block_tables, seq_lens, scale, first_slots, sliding_window,
    logit_softcap, return_attn_mass, num_splits,
):  # fmt: skip
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = pool.shape[2], pool.shape[3]
    if num_heads % num_kv_heads or pool.shape[4] != head_dim:
        raise ValueError(
            f"query [batch, {num_heads}, {head_dim}] does not fit a pool of {num_kv_heads} KV "
            f"heads of head_dim {pool.shape[4]}"
        )
    check_device(query, pool, block_tables, seq_lens)
    table_slots = block_tables.shape[1] * block_size
    if batch == 0 or table_slots == 0:  # nothing to read: as torch_ref, mass width 0
        out = torch.zeros_like(query)
        lse = torch.full((batch, num_heads), float("-inf"), device=query.device)
        mass = query.new_zeros((batch, num_kv_heads, 0), dtype=torch.float32)
        return out, lse, mass if return_attn_mass else None
    if first_slots is None:
        first_slots = torch.zeros_like(seq_lens)
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_tables = block_tables.contiguous()
    splits = num_splits or num_kv_splits(batch, num_kv_heads, table_slots, query.device)
    split_slots = triton.cdiv(triton.cdiv(table_slots, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(table_slots, split_slots)
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    lse = torch.empty((batch, num_heads), dtype=torch.float32, device=query.device)
    direct = splits == 1
    part_shape = (batch, num_heads, splits) if not direct else (0,)
    part_out = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=query.device)
    part_lse = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    scale_args = (pool, 0, 0, 0)  # unused by plain pages
    if scales is not None:
        scale_args = (scales, scales.stride(0), scales.stride(1), scales.stride(2))
    consts = dict(
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None, QUANT=quant,
        **dot_config(query, pool.dtype),
    )  # fmt: skip
    window = sliding_window if sliding_window is not None else 0
    cap = float(logit_softcap) if logit_softcap is not None else 1.0
    _decode_partial_kernel[(batch, num_kv_heads, splits)](
        query, query.stride(0), query.stride(1), pool, *pool_strides(pool), *scale_args,
        block_tables, block_tables.stride(0), seq_lens, first_slots, part_out, part_lse,
        splits, split_slots, out, out.stride(0), out.stride(1), lse, float(scale), window, cap,
        GROUP=group, BLOCK_H=dot_rows(group), DIRECT=direct, num_warps=NUM_WARPS, **consts,
    )  # fmt: skip
    if not direct:
        merge_kernel[(batch,)](
            part_out, part_lse, splits, out, out.stride(0), out.stride(1), lse,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_HEADS=triton.next_power_of_2(num_heads),
            BLOCK_D=consts["BLOCK_D"], BLOCK_S=triton.next_power_of_2(splits),
        )  # fmt: skip
    mass = None
    if return_attn_mass:
        mass = attention_mass(
            query, pool, scale_args, block_tables, seq_lens, first_slots, lse, float(scale),
            window, cap, split_slots, splits, group, consts,
        )  # fmt: skip
    return out, lse, mass
