"""Chunked-prefill attention reading the earlier chunks from the pages in place.

Semantics of ``torch_ref.attention_with_lse`` over the keys ``cached ++ chunk``: the
``num_cached`` held slots of the request's block table (earlier chunks, already in the pool)
followed by the chunk's own ``m`` keys, passed dense (they are written to the pages after the
attention, or not at all when the layer compresses). Query row ``i`` sits at key
``num_cached + i``, sees every key up to itself, optionally only the ``sliding_window`` most
recent, through an optional tanh soft-cap. The earlier keys are never gathered into a copy.

As SGLang's "extend" attention kernel: one program per (query head, tile of ``BLOCK_M``
queries) walks first the cached slots in tiles of ``BLOCK_N`` (each slot looks up its page in
the block table; the tiles left of the tile's window are skipped), then the chunk's keys up to
its diagonal, with one online softmax in fp32 across both (FlashAttention-2, Dao 2023). GQA
reads the KV head of the query head's group; K/V are never expanded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.attention.triton.common import check_device, pool_strides, softcap
from sparsekv.attention.triton.decode import dot_config

BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _online_softmax_tile(
    q, k, v, cols, valid, position, m_i, l_i, acc, sm_scale, window, cap,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile into the running (max, sum, accumulator) of a tile of query rows; keys at
    ``cols`` (sequence positions), rows at ``position``."""
    logits = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * sm_scale
    if HAS_SOFTCAP:
        logits = softcap(logits, cap)
    visible = valid[None, :] & (cols[None, :] <= position[:, None])
    if HAS_WINDOW:
        visible = visible & (cols[None, :] > position[:, None] - window)
    logits = tl.where(visible, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    alpha = tl.exp(m_i - safe_m)
    p = tl.exp(logits - safe_m[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(
        p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
    )
    return m_new, l_i, acc


@triton.jit
def _chunk_kernel(
    q_ptr, stride_qh, stride_qm, k_ptr, stride_kh, stride_kn, v_ptr, stride_vh, stride_vn,
    pool_ptr, stride_page, stride_kv, stride_head, stride_slot, table_ptr,
    out_ptr, stride_oh, stride_om, lse_ptr, num_queries, num_cached, sm_scale, window, cap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    kv_head = head // GROUP
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_queries
    position = rows + num_cached  # each query's own key position
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qm + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    first_position = tl.program_id(1) * BLOCK_M + num_cached
    start = first_position * 0
    if HAS_WINDOW:  # the first key any row of the tile sees
        start = tl.maximum(first_position - window + 1, 0)
    # 1. Earlier chunks, from the pages.
    head_base = pool_ptr + kv_head.to(tl.int64) * stride_head
    tile = start - start % BLOCK_N
    while tile < num_cached:  # a while loop: the interpreter cannot range() over loaded bounds
        cols = tile + tl.arange(0, BLOCK_N)
        valid = cols < num_cached
        page = tl.load(table_ptr + cols // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = (cols % BLOCK_SIZE).to(tl.int64)
        kv_ptrs = (head_base + page * stride_page + offset * stride_slot)[:, None] + dims[None, :]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(kv_ptrs + stride_kv, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_tile(
            q, k, v, cols, valid, position, m_i, l_i, acc, sm_scale, window, cap,
            HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
        tile += BLOCK_N
    # 2. The chunk itself, dense, up to the tile's last diagonal.
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    end = tl.minimum(tl.program_id(1) * BLOCK_M + BLOCK_M, num_queries)
    chunk_start = tl.maximum(start - num_cached, 0)
    tile = chunk_start - chunk_start % BLOCK_N
    while tile < end:
        local = tile + tl.arange(0, BLOCK_N)
        in_chunk = local < num_queries
        chunk_mask = in_chunk[:, None] & dim_mask[None, :]
        chunk_ptrs = local[:, None] * stride_kn + dims[None, :]
        chunk_k = tl.load(k_head + chunk_ptrs, mask=chunk_mask, other=0.0)
        chunk_v = tl.load(
            v_head + local[:, None] * stride_vn + dims[None, :], mask=chunk_mask, other=0.0
        )
        m_i, l_i, acc = _online_softmax_tile(
            q, chunk_k, chunk_v, local + num_cached, in_chunk, position, m_i, l_i, acc,
            sm_scale, window, cap, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
        tile += BLOCK_N

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + head.to(tl.int64) * stride_oh + rows[:, None] * stride_om + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + head.to(tl.int64) * num_queries + rows, lse, mask=row_mask)


def chunk_attention_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prefill chunk over the request's pages and itself, with LSE.

    Args:
        query: ``[num_heads, m, head_dim]`` fp32, bf16 or fp16, the chunk's queries.
        key, value: ``[num_kv_heads, m, head_dim]`` the chunk's own keys and values (any float
            dtype; multiplied in the query's dot dtype).
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` float pages, unit last
            stride.
        block_table: ``[>= ceil(num_cached / block_size)]`` int page ids, held slot 0 first.
        num_cached: held slots before the chunk (keys ``0 .. num_cached - 1`` of the table).
        scale: softmax scale.
        sliding_window: optional window in slots (a query sees itself and ``window - 1``
            earlier keys, counted over ``cached ++ chunk``).
        logit_softcap: optional tanh soft-cap of the logits.

    Returns:
        out ``[num_heads, m, head_dim]`` in the query dtype, lse ``[num_heads, m]`` fp32.

    Raises:
        ValueError: mismatched shapes, a pool of codes, a table too short for
            ``num_cached``, or devices.
    """
    num_heads, num_queries, head_dim = query.shape
    num_kv_heads, block_size = kv_pool.shape[2], kv_pool.shape[3]
    if (
        num_heads % num_kv_heads
        or key.shape != (num_kv_heads, num_queries, head_dim)
        or value.shape != key.shape
        or kv_pool.shape[4] != head_dim
    ):
        raise ValueError(
            f"query {tuple(query.shape)}, key/value {tuple(key.shape)} / {tuple(value.shape)} "
            f"and pool {tuple(kv_pool.shape)} do not form a chunk attention"
        )
    if kv_pool.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kv_pool must hold fp32, bf16 or fp16 pages, got {kv_pool.dtype}")
    if num_cached < 0 or block_table.numel() * block_size < num_cached:
        raise ValueError(
            f"block_table: {block_table.numel()} pages hold fewer than num_cached={num_cached}"
        )
    check_device(query, key, value, kv_pool, block_table)
    if num_queries == 0:
        empty = torch.empty((num_heads, 0), dtype=torch.float32, device=query.device)
        return query.clone(), empty
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    table = block_table.reshape(-1).contiguous()
    out = torch.empty_like(query)
    lse = torch.empty((num_heads, num_queries), dtype=torch.float32, device=query.device)
    grid = (num_heads, triton.cdiv(num_queries, BLOCK_M))
    _chunk_kernel[grid](
        query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1),
        value, value.stride(0), value.stride(1), kv_pool, *pool_strides(kv_pool), table,
        out, out.stride(0), out.stride(1), lse, num_queries, num_cached, float(scale),
        sliding_window if sliding_window is not None else 0,
        float(logit_softcap) if logit_softcap is not None else 1.0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None, **dot_config(query, kv_pool.dtype),
    )  # fmt: skip
    return out, lse
