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

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.attention.torch_ref import attention_mass_per_head

__all__ = [
    "aggregate_gqa",
    "attention_mass_per_head",
    "pool_scores",
    "prefill_attention_mass",
    "window_attention_scores",
]


def window_attention_scores(
    keys: torch.Tensor,
    window_queries: torch.Tensor,
    window_lse: torch.Tensor | None,
    scale: float,
    logit_softcap: float | None = None,
    backend: AttentionBackend | None = None,
    reduce: str = "sum",
) -> torch.Tensor:
    """SnapKV's observation-window scores ``S_h[j] = sum_{i in window} A_h[i, j]`` (or
    KVzip's ``max_i`` with ``reduce="max"``).

    Args:
        keys: ``[num_kv_heads, n, head_dim]`` held keys.
        window_queries: ``[num_heads, w, head_dim]`` queries of the last ``w <= n`` tokens.
        window_lse: ``[num_heads, w]`` their log-sum-exp over the held slots (causal), from the
            attention; used as given (the fused CPU kernel caps each term at 1, which only
            an lse below a row's logit exceeds). ``None`` computes it.
        scale: softmax scale.
        logit_softcap: the model's attention soft-cap (see :func:`attention_mass_per_head`).
        backend: the engine's attention backend (``AttentionBackend.window_scores``: the native
            CPU backend runs the fused or the paged window kernel where they take the tensors);
            ``None`` computes :func:`attention_mass_per_head` directly.
        reduce: ``sum`` or ``max`` over the window rows.

    Returns:
        ``[num_heads, n]`` fp32 summed (or max) window attention (not yet pooled or
        GQA-aggregated).
    """
    if backend is None:
        return attention_mass_per_head(
            keys, window_queries, window_lse, scale, logit_softcap=logit_softcap, reduce=reduce
        )
    return backend.window_scores(keys, window_queries, window_lse, scale, logit_softcap, reduce)


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
