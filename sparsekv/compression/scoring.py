"""Shared scoring math of the compressors: attention mass per slot, pooling, GQA aggregation.

SnapKV (arXiv 2404.14469), H2O (arXiv 2306.14048) and fused scoring (reuse the attention's LSE):
the softmax weight of query ``i`` on slot ``j`` is ``exp(q_i.k_j * scale - lse_i)``, so with the
log-sum-exp the attention kernel already returns, a slot's attention mass needs one pass over the
scoring queries only (cost ``num_queries x n``, never an ``n x n`` matrix at once).

Queries are always the *last* ``num_queries`` tokens of the ``n`` held slots: query ``i`` sits at
slot ``n - num_queries + i`` and sees slots ``j <= n - num_queries + i`` (causal by slot count, as
``sparsekv.attention.torch_ref.causal_mask``). Everything here is computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekv.attention.cpu import ops as native
from sparsekv.attention.cpu import window_fused
from sparsekv.attention.torch_ref import causal_mask

# Logit elements per chunk (64 MiB of fp32): bounds memory for long prompts.
_MAX_CHUNK_ELEMENTS = 1 << 24
# Page size of the pool the native window kernel reads gathered keys through.
_POOL_BLOCK = 16


def attention_mass_per_head(
    keys: torch.Tensor,
    queries: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    max_chunk_elements: int = _MAX_CHUNK_ELEMENTS,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Sum over query rows of the causal softmax weights on each slot, per query head.

    Works chunk-wise over query rows; a chunk only touches the slots its rows can see.

    Args:
        keys: ``[num_kv_heads, n, head_dim]`` held keys (post-RoPE), any float dtype.
        queries: ``[num_heads, q, head_dim]`` queries of the last ``q <= n`` tokens;
            ``num_heads`` is a multiple of ``num_kv_heads`` (GQA, query head ``h`` reads KV head
            ``h // group``).
        lse: ``[num_heads, q]`` natural-log softmax denominator of each row over the slots it
            sees, as returned by the attention; ``None`` computes it here.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        max_chunk_elements: most logit elements materialised at once.
        logit_softcap: the model's attention soft-cap: logits are ``cap * tanh(x / cap)`` of
            the scaled products (Gemma 2), as the attention computed them; ``None``: none.

    Returns:
        ``[num_heads, n]`` fp32: ``sum_i exp(l_ij - lse_i)`` over visible ``(i, j)``, with
        ``l_ij = q_i.k_j * scale`` (soft-capped when ``logit_softcap`` is set).
    """
    num_kv_heads, n, head_dim = keys.shape
    num_heads, q, _ = queries.shape
    assert num_heads % num_kv_heads == 0 and q <= n, (keys.shape, queries.shape)
    group = num_heads // num_kv_heads
    keys32 = keys.float()
    queries32 = queries.float().reshape(num_kv_heads, group, q, head_dim)
    lse32 = None if lse is None else lse.float().reshape(num_kv_heads, group, q)
    mass = torch.zeros(num_kv_heads, group, n, dtype=torch.float32, device=keys.device)
    rows = max(1, max_chunk_elements // max(1, num_heads * n))
    for start in range(0, q, rows):
        end = min(q, start + rows)
        num_visible = n - q + end  # the chunk's last row sees slots [0, num_visible)
        # [num_kv_heads, group, end - start, num_visible]; a group's query rows are folded
        # into one matrix per KV head (one bmm, no broadcast copy of the keys: ~3x faster).
        chunk = queries32[:, :, start:end].reshape(num_kv_heads, group * (end - start), head_dim)
        logits = torch.bmm(chunk, keys32[:, :num_visible].transpose(-1, -2))
        logits = logits.view(num_kv_heads, group, end - start, num_visible) * scale
        if logit_softcap is not None:
            logits = torch.tanh(logits / logit_softcap) * logit_softcap
        visible = causal_mask(end - start, num_visible, device=keys.device)
        logits.masked_fill_(~visible, float("-inf"))
        if lse32 is None:
            row_lse = torch.logsumexp(logits, dim=-1)
        else:
            row_lse = lse32[:, :, start:end]
        mass[:, :, :num_visible] += torch.exp(logits - row_lse[..., None]).sum(dim=2)
    return mass.reshape(num_heads, n)


def window_attention_scores(
    keys: torch.Tensor,
    window_queries: torch.Tensor,
    window_lse: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """SnapKV's observation-window scores ``S_h[j] = sum_{i in window} A_h[i, j]``.

    Args:
        keys: ``[num_kv_heads, n, head_dim]`` held keys.
        window_queries: ``[num_heads, w, head_dim]`` queries of the last ``w <= n`` tokens.
        window_lse: ``[num_heads, w]`` their log-sum-exp over the held slots (causal), from the
            attention; used as given. ``None`` computes it.
        scale: softmax scale.
        logit_softcap: the model's attention soft-cap (see :func:`attention_mass_per_head`).

    Returns:
        ``[num_heads, n]`` fp32 summed window attention (not yet pooled or GQA-aggregated).

    bf16 runs on the fused AMX kernel (``attention/cpu/window_fused.py``: the LSE, when not
    given, and the sums in one pass); other dtypes on the native window-score kernel
    (``attention/cpu``) when it takes these tensors; else :func:`attention_mass_per_head`.
    All equal the dense definition (``tests/unit/test_scoring_native.py``,
    ``tests/unit/test_kernels_window_fused.py``). ``SPARSEKV_DISABLE_NATIVE=1`` forces the
    last. A soft-capped model always takes the last (the kernels do not cap).
    """
    if logit_softcap is not None:
        return attention_mass_per_head(
            keys, window_queries, window_lse, scale, logit_softcap=logit_softcap
        )
    if _fused_window_ready(keys, window_queries):
        lse = None if window_lse is None else window_lse.float().contiguous()
        return window_fused.window_scores_fused(window_queries, keys, lse, scale)[0]
    if _native_window_ready(keys, window_queries):
        return _native_window_scores(keys, window_queries, window_lse, scale)
    return attention_mass_per_head(keys, window_queries, window_lse, scale)


def _fused_window_ready(keys: torch.Tensor, window_queries: torch.Tensor) -> bool:
    return (
        0 < window_queries.shape[1] <= keys.shape[1]
        and keys.stride(2) == 1
        and window_fused.supports_window_fused_dense(window_queries, keys)
    )


def _native_window_ready(keys: torch.Tensor, window_queries: torch.Tensor) -> bool:
    num_kv_heads, n, head_dim = keys.shape
    return (
        0 < window_queries.shape[1] <= n
        and window_queries.dtype == keys.dtype
        and native.supports(window_queries, keys.new_empty(1, 2, 1, 1, head_dim))
    )


def _native_window_scores(
    keys: torch.Tensor, window_queries: torch.Tensor, window_lse: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``window_attention_scores`` on the native kernel: the keys become a page pool of
    ``_POOL_BLOCK``-slot pages (value halves left unset: the kernel reads keys only), and missing
    log-sum-exps come from the flash kernel with each group's rows folded onto its KV head."""
    num_kv_heads, n, head_dim = keys.shape
    num_blocks = -(-n // _POOL_BLOCK)
    pool = keys.new_empty(num_blocks, 2, num_kv_heads, _POOL_BLOCK, head_dim)
    # Padding slots lie past num_slots; zeroed so no NaN is ever read.
    padded = F.pad(keys, (0, 0, 0, num_blocks * _POOL_BLOCK - n))
    pool[:, 0] = padded.view(num_kv_heads, num_blocks, _POOL_BLOCK, head_dim).transpose(0, 1)
    if window_lse is None:
        window_lse = _window_lse(keys, window_queries, scale)
    table = torch.arange(num_blocks, dtype=torch.int64)
    # Support was checked by _native_window_ready: the kernel directly, not the dispatching
    # backend (which would check it again).
    return native.window_scores_paged(window_queries, window_lse.float(), pool, table, n, scale)


def _window_lse(keys: torch.Tensor, window_queries: torch.Tensor, scale: float) -> torch.Tensor:
    """``[num_heads, w]`` fp32 log-sum-exp of the window rows over the slots each one sees.

    Every row sees the first ``n - w`` slots: one unmasked flash call covers them, with a KV
    head's ``group x w`` query rows folded into one query matrix (no copy of the keys per query
    head; the keys stand in for the values, whose output is discarded). The causal ``w x w``
    corner is exact fp32 logits; the two parts merge by ``logaddexp``.
    """
    num_kv_heads, n, head_dim = keys.shape
    num_heads, w, _ = window_queries.shape
    group = num_heads // num_kv_heads
    folded = window_queries.reshape(num_kv_heads, group * w, head_dim)
    corner = torch.matmul(folded.float(), keys[:, n - w :].float().transpose(1, 2)) * scale
    visible = causal_mask(w, w).repeat(group, 1)
    lse = torch.logsumexp(corner.masked_fill_(~visible, float("-inf")), dim=-1)
    if n > w:
        head = keys[None, :, : n - w]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        lse = torch.logaddexp(lse, flash(folded[None], head, head, scale=scale)[1][0].float())
    return lse.reshape(num_heads, w)


def prefill_attention_mass(
    keys: torch.Tensor,
    queries: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """H2O's accumulated attention after prefill: causal column sums per KV head.

    Args:
        keys: ``[num_kv_heads, n, head_dim]`` the prompt's keys.
        queries: ``[num_heads, q, head_dim]`` queries of the last ``q <= n`` tokens (all prompt
            tokens for a one-shot prefill; one chunk's tokens to add a chunk's share).
        lse: ``[num_heads, q]`` their log-sum-exp from the attention, or ``None``.
        scale: softmax scale.
        logit_softcap: the model's attention soft-cap (see :func:`attention_mass_per_head`).

    Returns:
        ``[num_kv_heads, n]`` fp32 attention mass per slot, summed over the query rows and over
        the query heads of each KV group (the same convention as ``paged_decode_attention``'s
        ``return_attn_mass``, so decode steps add to it directly).
    """
    mass = attention_mass_per_head(keys, queries, lse, scale, logit_softcap=logit_softcap)
    num_kv_heads, n = keys.shape[0], keys.shape[1]
    return mass.reshape(num_kv_heads, queries.shape[0] // num_kv_heads, n).sum(dim=1)


def pool_scores(scores: torch.Tensor, pooling: str, kernel_size: int) -> torch.Tensor:
    """Smooth scores along the token axis (SnapKV): stride 1, padding ``kernel_size // 2``.

    Mirrors kvpress / SnapKV: ``avg`` is ``F.avg_pool1d`` with its default
    ``count_include_pad=True`` (edge windows are divided by ``kernel_size``), ``max`` is
    ``F.max_pool1d`` (padding never wins).

    Args:
        scores: ``[num_rows, m]`` fp32.
        pooling: ``max``, ``avg`` or ``none``.
        kernel_size: odd kernel width in tokens.

    Returns:
        ``[num_rows, m]`` fp32.
    """
    if pooling == "none" or kernel_size == 1 or scores.shape[-1] == 0:
        return scores
    pool = {"max": F.max_pool1d, "avg": F.avg_pool1d}[pooling]
    pooled = pool(scores[:, None, :], kernel_size=kernel_size, stride=1, padding=kernel_size // 2)
    return pooled[:, 0, :]


def aggregate_gqa(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """Aggregate the query heads of each KV group: ``[num_heads, m] -> [num_kv_heads, m]``.

    Args:
        scores: ``[num_heads, m]``; query heads ``g * group .. (g + 1) * group - 1`` share KV
            head ``g``.
        num_kv_heads: KV heads.
        how: ``mean`` or ``max``.
    """
    group = scores.shape[0] // num_kv_heads
    grouped = scores.reshape(num_kv_heads, group, scores.shape[-1])
    return _GQA_AGGREGATIONS[how](grouped)


_GQA_AGGREGATIONS = {
    "mean": lambda grouped: grouped.mean(dim=1),
    "max": lambda grouped: grouped.amax(dim=1),
}
