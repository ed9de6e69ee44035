"""SnapKV window scores in Triton (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for
Before Generation"): the attention each held slot receives from the observation window,
summed over the window rows.

``out[h, j] = sum_i exp(l_ij - lse_i)`` over the window rows ``i`` that see slot ``j`` (row
``i`` is the query of slot ``num_slots - window + i``), ``l_ij = q_i . k_j * scale``,
soft-capped when asked: ``attention.reference.window_scores_paged`` per layer. The rows' LSE
is given (the prefill attention returned it) or computed first by ``_window_lse_kernel`` over
exactly the slots each row sees (decode-time re-scoring). One program per (query head, tile of
slots) holds the head's whole window (``window`` rows padded to a ``tl.dot`` tile).

Keys come from pages through one block table per layer (several layers' heads stacked
layer-major, as decode-time compaction scores a request's layers at once), or from dense
``[num_kv_heads, n, head_dim]`` keys seen as one page of ``n`` slots (no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.attention.triton.common import check_device, dot_rows, pool_strides, softcap
from sparsekv.attention.triton.decode import dot_config

BLOCK_N = 32
ONE_PAGE = 1 << 30  # block size that puts every slot of dense keys in page 0


@triton.jit
def _window_logits(
    q, table_row, head_base, tile, num_slots, num_window, dims, dim_mask, window_rows,
    sm_scale, cap, stride_page, stride_slot, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Logits ``[BLOCK_W, BLOCK_N]`` of the window rows over one tile of held slots, ``-inf``
    where a row does not see the slot (or either is padding)."""
    slots = tile + tl.arange(0, BLOCK_N)
    slot_mask = slots < num_slots
    page = tl.load(table_row + slots // BLOCK_SIZE, mask=slot_mask, other=0).to(tl.int64)
    offset = (slots % BLOCK_SIZE).to(tl.int64)
    k_ptrs = (head_base + page * stride_page + offset * stride_slot)[:, None] + dims[None, :]
    k = tl.load(k_ptrs, mask=slot_mask[:, None] & dim_mask[None, :], other=0.0)
    logits = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * sm_scale
    if HAS_SOFTCAP:
        logits = softcap(logits, cap)
    last_seen = num_slots - num_window + window_rows  # row i sees slots up to this one
    visible = (slots[None, :] <= last_seen[:, None]) & (window_rows < num_window)[:, None]
    return tl.where(visible & slot_mask[None, :], logits, float("-inf")), slots, slot_mask


@triton.jit
def _window_setup(
    q_ptr, stride_qh, stride_qw, pool_ptr, stride_head, table_ptr, stride_tl, num_window,
    heads_per_layer, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The program's query head: its window rows, block table row and KV head's base."""
    head = tl.program_id(0)
    rows = tl.arange(0, BLOCK_W)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + head * stride_qh + rows[:, None] * stride_qw + dims[None, :]
    q_mask = (rows < num_window)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(DOT_DTYPE)
    layer = head // heads_per_layer
    kv_head = (head % heads_per_layer) // GROUP
    head_base = pool_ptr + kv_head.to(tl.int64) * stride_head
    return head, rows, dims, dim_mask, q, table_ptr + layer * stride_tl, head_base


@triton.jit
def _window_lse_kernel(
    q_ptr, stride_qh, stride_qw, pool_ptr, stride_page, stride_head, stride_slot, table_ptr,
    stride_tl, lse_ptr, num_slots, num_window, heads_per_layer, sm_scale, cap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head, rows, dims, dim_mask, q, table_row, head_base = _window_setup(
        q_ptr, stride_qh, stride_qw, pool_ptr, stride_head, table_ptr, stride_tl, num_window,
        heads_per_layer, GROUP, HEAD_DIM, BLOCK_D, BLOCK_W, DOT_DTYPE,
    )  # fmt: skip
    m_i = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_W], tl.float32)
    tile = num_slots * 0
    while tile < num_slots:
        logits, _, _ = _window_logits(
            q, table_row, head_base, tile, num_slots, num_window, dims, dim_mask, rows,
            sm_scale, cap, stride_page, stride_slot, BLOCK_SIZE, BLOCK_N, HAS_SOFTCAP,
            DOT_DTYPE, DOT_PRECISION,
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
    q_ptr, stride_qh, stride_qw, pool_ptr, stride_page, stride_head, stride_slot, table_ptr,
    stride_tl, lse_ptr, stride_lh, out_ptr, num_slots, num_window, heads_per_layer, sm_scale,
    cap, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head, rows, dims, dim_mask, q, table_row, head_base = _window_setup(
        q_ptr, stride_qh, stride_qw, pool_ptr, stride_head, table_ptr, stride_tl, num_window,
        heads_per_layer, GROUP, HEAD_DIM, BLOCK_D, BLOCK_W, DOT_DTYPE,
    )  # fmt: skip
    lse = tl.load(lse_ptr + head * stride_lh + rows, mask=rows < num_window, other=float("inf"))
    logits, slots, slot_mask = _window_logits(
        q, table_row, head_base, tl.program_id(1) * BLOCK_N, num_slots, num_window, dims,
        dim_mask, rows, sm_scale, cap, stride_page, stride_slot, BLOCK_SIZE, BLOCK_N,
        HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    scores = tl.sum(tl.exp(logits - lse.to(tl.float32)[:, None]), 0)
    tl.store(out_ptr + head.to(tl.int64) * num_slots + slots, scores, mask=slot_mask)


def window_scores_paged(
    window_queries: torch.Tensor,
    lse: torch.Tensor | None,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    num_slots: int,
    scale: float,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window scores over paged keys, one or several layers at once.

    Args:
        window_queries: ``[layers * num_heads, window, head_dim]`` fp32, bf16 or fp16 (heads
            stacked layer-major), ``window <= num_slots``.
        lse: ``[layers * num_heads, window]`` fp32 LSE of each row over the slots it sees, or
            ``None`` to compute it here.
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``, unit last stride.
        block_tables: ``[num_blocks]`` (one layer) or ``[layers, num_blocks]`` int page ids,
            slot 0 first.
        num_slots: held slots of every layer.
        scale: softmax scale.
        logit_softcap: optional tanh soft-cap of the logits.

    Returns:
        scores ``[layers * num_heads, num_slots]`` fp32 per query head (not aggregated over a
        group), and the rows' lse ``[layers * num_heads, window]`` fp32 (the given one).

    Raises:
        ValueError: a window longer than the held slots, mismatched heads, or devices.
    """
    tables = block_tables.reshape(-1, block_tables.shape[-1]).contiguous()
    check_device(window_queries, kv_pool, tables)
    stride_page, _, stride_head, stride_slot = pool_strides(kv_pool)
    pages = (kv_pool, stride_page, stride_head, stride_slot, tables, tables.stride(0))
    shape = (kv_pool.shape[2], kv_pool.shape[3], kv_pool.shape[4])
    return _launch(window_queries, lse, pages, shape, num_slots, scale, logit_softcap)


def window_scores_dense(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`window_scores_paged` over dense keys ``[num_kv_heads, n, head_dim]`` (unit last
    stride), read in place as one page of ``n`` slots; ``n`` is the held slot count."""
    check_device(window_queries, keys)
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    table = torch.zeros((1, 1), dtype=torch.int32, device=keys.device)
    pages = (keys, 0, keys.stride(0), keys.stride(1), table, 1)
    shape = (keys.shape[0], ONE_PAGE, keys.shape[2])
    return _launch(window_queries, lse, pages, shape, keys.shape[1], scale, logit_softcap)


def _launch(queries, lse, pages, shape, num_slots, scale, logit_softcap):
    """Run the LSE kernel where needed, then the score kernel; ``pages`` = (keys tensor,
    page / head / slot strides, tables ``[layers, blocks]``, table row stride), ``shape`` =
    (num_kv_heads, block_size, head_dim)."""
    num_rows, num_window, head_dim = queries.shape
    num_kv_heads, block_size, pool_head_dim = shape
    num_layers = pages[4].shape[0]
    heads = num_rows // num_layers
    if num_window > num_slots or num_rows % num_layers or heads % num_kv_heads:
        raise ValueError(
            f"window_queries {tuple(queries.shape)} do not fit {num_layers} layer(s) of "
            f"{num_slots} held slots and {num_kv_heads} KV heads"
        )
    if pool_head_dim != head_dim:
        raise ValueError(f"window_queries: head_dim {head_dim}, keys have {pool_head_dim}")
    device = queries.device
    out = torch.zeros((num_rows, num_slots), dtype=torch.float32, device=device)
    if num_slots == 0 or num_window == 0 or num_rows == 0:
        empty = torch.zeros((num_rows, num_window), dtype=torch.float32, device=device)
        return out, lse if lse is not None else empty
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    consts = dict(
        GROUP=heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_W=dot_rows(num_window), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        HAS_SOFTCAP=logit_softcap is not None, **dot_config(queries, pages[0].dtype),
    )  # fmt: skip
    cap = float(logit_softcap) if logit_softcap is not None else 1.0
    args = (queries, queries.stride(0), queries.stride(1), *pages)
    if lse is None:
        lse = torch.empty((num_rows, num_window), dtype=torch.float32, device=device)
        _window_lse_kernel[(num_rows,)](
            *args, lse, num_slots, num_window, heads, float(scale), cap, **consts
        )
    lse = lse if lse.stride(-1) == 1 else lse.contiguous()
    _window_scores_kernel[(num_rows, triton.cdiv(num_slots, BLOCK_N))](
        *args, lse, lse.stride(0), out, num_slots, num_window, heads, float(scale), cap, **consts
    )
    return out, lse
