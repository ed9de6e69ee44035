"""Wrappers of the fused window-score kernels (``csrc/window_fused.h``).

SnapKV-family scoring needs, per window row, the softmax denominator over the slots the row
sees and then the summed probabilities per slot. This kernel does both in one pass over the
keys: each logit is computed once into a cache-resident buffer (on AMX tiles, ``avx512_amx``;
with AVX512-BF16 dot products, ``avx512_bf16``: AMD Zen 4, Intel Cooper Lake; with fp32 FMAs on
AVX2, ``avx2``: AMD Zen 1-3, Intel Haswell and later; or portable C++, ``generic``) and takes
one exponential, against two (plus a value product) for an attention call followed by the
window-score kernel. It reads keys either dense or in pages, several layers at once. bf16 runs
on every variant; fp32 (queries and keys alike) on the fp32-FMA ones, ``avx2`` and ``generic``,
with fp32 logits.
``SPARSEKV_KERNEL_ISA`` picks a variant as for the other kernels; naming a variant of the
decode kernels only (``avx512``, ``avx2_w16``) turns the fused kernel off (callers take the
unfused route). The kernels do not soft-cap logits: soft-capped models take the reference.
"""

from __future__ import annotations

import functools

import torch

from sparsekv.attention.cpu import build
from sparsekv.attention.cpu.ops import (
    BF16_ISA,
    PREFILL_ISA,
    _extension,
    check_softmax_scale,
)
from sparsekv.env_flags import kernel_isa_setting

VARIANTS = (PREFILL_ISA, BF16_ISA, "avx2", "generic")  # fastest first
FP32_VARIANTS = ("avx2", "generic")  # the variants that take fp32 queries and keys
DTYPES = (torch.bfloat16, torch.float32)


def window_fused_isas(dtype: torch.dtype = torch.bfloat16) -> tuple[str, ...]:
    """Fused window-score variants this CPU runs for queries and keys of ``dtype`` (bf16: all;
    fp32: :data:`FP32_VARIANTS`), fastest first (empty without the extension)."""
    ext = build.load_extension()
    isas = _isas(ext) if ext is not None else ()
    return isas if dtype == torch.bfloat16 else tuple(v for v in isas if v in FP32_VARIANTS)


@functools.cache
def _isas(ext) -> tuple[str, ...]:
    names = str(ext.window_fused_isas())
    return tuple(names.split(",")) if names else ()


def window_fused_isa(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """The variant the wrappers run for ``dtype``: the one ``SPARSEKV_KERNEL_ISA`` names if
    this CPU runs it for that dtype (``None`` where it names another variant: the fused kernel
    is off), else the fastest; ``None`` for another dtype."""
    if dtype not in DTYPES:
        return None
    isas = window_fused_isas(dtype)
    forced = kernel_isa_setting()  # read per call: tests set it
    if forced:
        return forced if forced in isas else None
    return isas[0] if isas else None


def supports_window_fused(window_queries: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """True when :func:`window_scores_fused_paged` takes ``window_queries`` ``[num_heads, w,
    head_dim]`` over this pool: CPU tensors, both bf16 or both fp32, head_dim a multiple of 32,
    pages of a multiple of 16 slots, no autograd, and a kernel variant for the dtype
    (:func:`window_fused_isa`)."""
    return (
        kv_pool.dim() == 5
        and kv_pool.shape[3] % 16 == 0
        and kv_pool.is_contiguous()
        and supports_window_fused_dense(window_queries, kv_pool)
    )


def supports_window_fused_dense(window_queries: torch.Tensor, keys: torch.Tensor) -> bool:
    """True when :func:`window_scores_fused` takes these window queries and keys (dense
    ``[num_kv_heads, n, head_dim]``, or a page pool): CPU, both bf16 or both fp32, ``head_dim``
    a multiple of 32, no autograd, a kernel variant for the dtype (:func:`window_fused_isa`)."""
    head_dim = keys.shape[-1]
    return (
        window_queries.dtype == keys.dtype
        and window_queries.device.type == keys.device.type == "cpu"
        and head_dim % 32 == 0
        and window_queries.shape[-1] == head_dim
        and not window_queries.requires_grad
        and window_fused_isa(keys.dtype) is not None
    )


def window_scores_fused(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed window attention and the window rows' log-sum-exps in one pass.

    Args:
        window_queries: ``[num_heads, w, head_dim]`` bf16 or fp32, the queries of the last
            ``w`` of ``n`` positions (row ``i`` sees keys ``j <= n - w + i``).
        keys: ``[num_kv_heads, n, head_dim]`` of the queries' dtype (any row stride); fp32
            runs on :data:`FP32_VARIANTS` only; query head ``h`` reads
            KV head ``h // (num_heads // num_kv_heads)``.
        lse: ``[num_heads, w]`` contiguous fp32 log-sum-exps to use, or ``None`` to compute
            them.
        scale: softmax scale, positive.
        isa: the variant to run (one of :func:`window_fused_isas`), or ``None`` for
            :func:`window_fused_isa`'s.

    Returns:
        scores ``[num_heads, n]`` fp32 (``sum_i min(1, exp(q_i . k_j * scale - lse_i))``:
        SnapKV's window sums; the cap applies only where a given lse is below the row's
        logit, e.g. an fp32 lse of logits near 1e9, or the lse of other logits) and lse
        ``[num_heads, w]`` fp32 (natural log; the given one when passed).

    Raises:
        ValueError: ``scale`` is not a positive finite number.
        RuntimeError: the extension or its kernel is unavailable, or it rejects the
            arguments (fp32 on a bf16-only variant, mixed dtypes).
    """
    check_softmax_scale(scale)
    ext = _extension()
    isa = isa or window_fused_isa(keys.dtype) or PREFILL_ISA
    scores, lse_out = ext.window_scores_fused(window_queries, keys, lse, float(scale), isa)
    return scores, lse_out


def window_scores_fused_paged(
    window_queries: torch.Tensor,
    kv_pool: torch.Tensor,
    tables: torch.Tensor,
    num_slots: int,
    lse: torch.Tensor | None,
    scale: float,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`window_scores_fused` with the keys read from pages in place, for several
    layers' block tables at once (their heads stacked layer-major).

    Args:
        window_queries: ``[layers * num_heads, w, head_dim]`` bf16 or fp32.
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` of the queries' dtype,
            contiguous, ``block_size`` a multiple of 16.
        tables: ``[layers, >= ceil(num_slots / block_size)]`` contiguous int64 page ids.
        num_slots: held slots ``n`` of every layer.
        lse, scale: as :func:`window_scores_fused`.
        isa: the variant to run (one of :func:`window_fused_isas`), or ``None`` for
            :func:`window_fused_isa`'s.

    Returns:
        scores ``[layers * num_heads, num_slots]`` and lse ``[layers * num_heads, w]``, fp32.

    Raises:
        ValueError: as :func:`window_scores_fused`.
        RuntimeError: as :func:`window_scores_fused`, or a page id out of range.
    """
    check_softmax_scale(scale)
    ext = _extension()
    scores, lse_out = ext.window_scores_fused_paged(
        window_queries,
        kv_pool,
        tables,
        int(num_slots),
        lse,
        float(scale),
        isa or window_fused_isa(kv_pool.dtype) or PREFILL_ISA,
    )
    return scores, lse_out
