"""Causal attention with the log-sum-exp of every query row (prompts and prefill chunks).

Semantics of ``torch_ref.attention_with_lse``: the ``num_queries`` queries are the last
``num_queries`` of ``num_keys`` keys (a whole prompt, or a chunk after earlier chunks), each
sees the keys up to its own position, optionally only the ``sliding_window`` most recent, and
optionally through a tanh soft-cap of its logits. GQA without expanding K/V.

On CUDA, 16-bit inputs without soft-cap go to PyTorch's FlashAttention-2 kernel
(``aten._flash_attention_forward``), which returns the row LSE, aligns the causal diagonal to
the bottom-right corner (queries are the last keys) and takes a left window: nothing to write.
Everything else runs ``_prefill_kernel``, a FlashAttention-2 style forward (Dao 2023): one
program per (query head, tile of ``BLOCK_M`` queries), key tiles from the first one its window
sees up to its diagonal, online softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.attention.triton.common import check_device, softcap
from sparsekv.attention.triton.decode import dot_config

BLOCK_M = 16
BLOCK_N = 32
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qh, stride_qm, k_ptr, stride_kh, stride_kn, v_ptr, stride_vh, stride_vn,
    out_ptr, stride_oh, stride_om, lse_ptr, num_queries, num_keys, sm_scale, window, cap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    kv_head = head // GROUP
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_queries
    position = rows + (num_keys - num_queries)  # each query's own key index
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = q_ptr + head.to(tl.int64) * stride_qh + rows[:, None] * stride_qm + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)

    first_row = tl.program_id(1) * BLOCK_M + (num_keys - num_queries)
    end = tl.minimum(first_row + BLOCK_M, num_keys)  # past the tile's last diagonal
    start = first_row * 0
    if HAS_WINDOW:
        start = tl.maximum(first_row - window + 1, 0)
        start = start - start % BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    tile = start
    while tile < end:
        cols = tile + tl.arange(0, BLOCK_N)
        col_mask = cols < num_keys
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_head + cols[:, None] * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + cols[:, None] * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
        logits = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * sm_scale
        if HAS_SOFTCAP:
            logits = softcap(logits, cap)
        visible = col_mask[None, :] & (cols[None, :] <= position[:, None])
        if HAS_WINDOW:
            visible = visible & (cols[None, :] > position[:, None] - window)
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        alpha = tl.exp(m_i - safe_m)
        p = tl.exp(logits - safe_m[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        tile += BLOCK_N

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + head.to(tl.int64) * stride_oh + rows[:, None] * stride_om + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + head.to(tl.int64) * num_queries + rows, lse, mask=row_mask)


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    use_flash: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the last ``num_queries`` tokens over ``num_keys`` keys, with LSE.

    Args:
        query: ``[num_heads, num_queries, head_dim]`` fp32, bf16 or fp16.
        key, value: ``[num_kv_heads, num_keys, head_dim]``, ``num_keys >= num_queries``,
            ``num_heads`` a multiple of ``num_kv_heads``.
        scale: softmax scale.
        sliding_window: optional window in slots (a query sees itself and ``window - 1``
            earlier keys).
        logit_softcap: optional tanh soft-cap of the logits.
        use_flash: run PyTorch's flash kernel (``None``: where it applies, see
            :func:`flash_applies`; ``False`` forces the Triton kernel).

    Returns:
        out ``[num_heads, num_queries, head_dim]`` in the query dtype, lse
        ``[num_heads, num_queries]`` fp32 natural log.

    Raises:
        ValueError: mismatched shapes or devices, or ``use_flash`` where it cannot run.
    """
    num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys, _ = key.shape
    if num_heads % num_kv_heads or num_keys < num_queries or key.shape != value.shape:
        raise ValueError(
            f"query {tuple(query.shape)} and key/value {tuple(key.shape)} / "
            f"{tuple(value.shape)} do not form a causal attention"
        )
    check_device(query, key, value)
    applies = flash_applies(query, key, logit_softcap)
    if use_flash and not applies:
        raise ValueError("use_flash: PyTorch's flash kernel does not take these inputs")
    if num_queries == 0:
        empty = torch.empty((num_heads, 0), dtype=torch.float32, device=query.device)
        return query.clone(), empty
    if applies and use_flash is not False:
        return _flash(query, key, value, scale, sliding_window)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty_like(query)
    lse = torch.empty((num_heads, num_queries), dtype=torch.float32, device=query.device)
    grid = (num_heads, triton.cdiv(num_queries, BLOCK_M))
    _prefill_kernel[grid](
        query, query.stride(0), query.stride(1), key, key.stride(0), key.stride(1),
        value, value.stride(0), value.stride(1), out, out.stride(0), out.stride(1), lse,
        num_queries, num_keys, float(scale),
        sliding_window if sliding_window is not None else 0,
        float(logit_softcap) if logit_softcap is not None else 1.0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap is not None,
        **dot_config(query, key.dtype),
    )  # fmt: skip
    return out, lse


def flash_applies(query: torch.Tensor, key: torch.Tensor, logit_softcap: float | None) -> bool:
    """True when PyTorch's CUDA flash kernel computes this attention: CUDA fp16 / bf16
    queries and keys of one dtype, head_dim a multiple of 8 up to 256, no soft-cap."""
    head_dim = query.shape[-1]
    return (
        query.device.type == "cuda"
        and query.dtype in FLASH_DTYPES
        and key.dtype == query.dtype
        and head_dim % 8 == 0
        and head_dim <= 256
        and logit_softcap is None
    )


def _flash(query, key, value, scale, sliding_window):
    """``aten._flash_attention_forward`` on ``[1, n, heads, d]`` views: causal aligned to the
    bottom-right (FlashAttention-2's convention when queries are fewer than keys), GQA
    native, a left window of ``sliding_window - 1`` keys; its LSE is natural-log fp32."""
    num_queries, num_keys = query.shape[1], key.shape[1]
    window_left = sliding_window - 1 if sliding_window is not None else None
    out, lse = torch.ops.aten._flash_attention_forward(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        None,
        None,
        num_queries,
        num_keys,
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=window_left,
        window_size_right=0 if window_left is not None else None,
    )[:2]
    return out[0].transpose(0, 1), lse[0, :, :num_queries].float()
