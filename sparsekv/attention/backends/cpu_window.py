"""Window scores over dense keys on the native kernels, for ``CpuNativeBackend.window_scores``.

The keys of a prefill step are activations, not pages: they are laid into a pool of
``POOL_BLOCK``-slot pages for the kernel, and a missing log-sum-exp comes from PyTorch's CPU
flash kernel. The fused kernel (``window_fused``) takes bf16, and fp32 on its fp32-FMA
variants, where the CPU has one; the paged kernel (``ops.window_scores_paged``) the rest it
supports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekv.attention.cpu import ops as native
from sparsekv.attention.cpu import window_fused
from sparsekv.attention.torch_ref import causal_mask

# Page size of the pool the native window kernel reads gathered keys through.
_POOL_BLOCK = 16


def fused_window_ready(keys: torch.Tensor, window_queries: torch.Tensor) -> bool:
    """True when ``window_fused.window_scores_fused`` takes these dense keys and queries."""
    return (
        0 < window_queries.shape[1] <= keys.shape[1]
        and keys.stride(2) == 1
        and window_fused.supports_window_fused_dense(window_queries, keys)
    )


def native_window_ready(keys: torch.Tensor, window_queries: torch.Tensor) -> bool:
    """True when :func:`native_window_scores` takes these dense keys and queries."""
    num_kv_heads, n, head_dim = keys.shape
    return (
        0 < window_queries.shape[1] <= n
        and window_queries.dtype == keys.dtype
        and native.supports(window_queries, keys.new_empty(1, 2, 1, 1, head_dim))
    )


def native_window_scores(
    keys: torch.Tensor, window_queries: torch.Tensor, window_lse: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Window scores over dense keys on the paged window kernel: the keys become a page pool of
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
