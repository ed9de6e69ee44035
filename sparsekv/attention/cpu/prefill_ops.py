"""Native causal prefill (flash) attention: the Python face of ``csrc/prefill*.h``.

``prefill_attention`` is the causal attention of a prompt, or of a chunk after its earlier keys,
with the log-sum-exp of every row, against ``torch_ref.attention_with_lse``. Its variants
(``prefill_isas``), fastest first: ``avx512_amx`` (AMX tiles) and ``avx512_bf16``
(AVX512-BF16 dot products: AMD Zen 4, Intel Cooper Lake), bf16 only; ``avx512``, ``avx2`` and
``generic`` (fp32 FMAs), which take bf16 (converted to fp32) and fp32 inputs alike.
``SPARSEKV_KERNEL_ISA`` picks one as for the decode kernels: a variant without a prefill kernel
(``avx2_w16``) leaves prefill to PyTorch; a bf16-only one leaves fp32 inputs on the fastest
fp32 variant, as the decode kernels run fp32 pools on their vector kernels under
``avx512_amx``. ``avx512_bf16`` names no decode variant of its own: forced, the decode kernels
run ``avx512``.

``qk_int8=True`` computes the logits in int8 on ``avx512_bf16`` (AVX512-VNNI), SageAttention-style:
keys smoothed by their channel means and quantized per key, queries per row, the value product
in bf16 as before (``prefill_qk_int8_runs`` says where it applies).
"""

from __future__ import annotations

import functools
import warnings

import torch

from sparsekv.attention.cpu import build
from sparsekv.attention.cpu.ops import (
    BF16_ISA,
    ISA_ENV,
    PREFILL_ISA,
    _extension,
    check_softmax_scale,
)
from sparsekv.env_flags import kernel_isa_setting

PREFILL_VARIANTS = (PREFILL_ISA, BF16_ISA, "avx512", "avx2", "generic")  # fastest first
# Variants of other kernel families without a prefill kernel: forcing one leaves prefill to
# PyTorch (any other name is not a variant: a warning, and the default).
NO_PREFILL_VARIANTS = ("avx2_w16", "avx512_vnni")
FP32_VARIANTS = ("avx512", "avx2", "generic")  # the variants that take fp32 inputs
PREFILL_DTYPES = (torch.bfloat16, torch.float32)


def prefill_isas(dtype: torch.dtype = torch.bfloat16) -> tuple[str, ...]:
    """Prefill kernel variants this CPU runs for inputs of ``dtype`` (bf16: all of them; fp32:
    :data:`FP32_VARIANTS`), fastest first (empty without the extension)."""
    ext = build.load_extension()
    isas = _prefill_isas(ext) if ext is not None else ()
    return isas if dtype == torch.bfloat16 else tuple(v for v in isas if v in FP32_VARIANTS)


@functools.cache
def _prefill_isas(ext) -> tuple[str, ...]:
    names = str(ext.prefill_isas())
    return tuple(names.split(",")) if names else ()


QK_INT8_MAX_HEAD_DIM = 256  # the int8 kernel's per-row buffers


def prefill_qk_int8_status() -> str:
    """``"ok"`` when this CPU runs the int8 Q·K^T prefill kernel (AVX512-BF16 and AVX512-VNNI),
    else why not."""
    ext = build.load_extension()
    return "native kernels unavailable" if ext is None else _qk_int8_status(ext)


@functools.cache
def _qk_int8_status(ext) -> str:
    return str(ext.prefill_qk_int8_status())


def prefill_qk_int8_runs(
    dtype: torch.dtype = torch.bfloat16, isa: str | None = None, head_dim: int | None = None
) -> bool:
    """True when :func:`prefill_attention` with ``qk_int8=True`` computes int8 logits for
    inputs of ``dtype`` (and ``head_dim``, if given) on variant ``isa`` (default
    :func:`prefill_isa`): bf16 with ``head_dim`` up to 256 on ``avx512_bf16`` where
    :func:`prefill_qk_int8_status` is ok. Elsewhere the flag is ignored: the AMX tiles' bf16
    products outrun AVX512-VNNI's int8 ones, and the fp32 variants keep fp32 models exact."""
    if head_dim is not None and head_dim > QK_INT8_MAX_HEAD_DIM:
        return False
    variant = isa or prefill_isa(dtype)
    return dtype == torch.bfloat16 and variant == BF16_ISA and prefill_qk_int8_status() == "ok"


def prefill_isa_status(isa: str) -> str:
    """``"ok"`` when this CPU runs prefill variant ``isa``, else why not (the missing CPU
    feature, no AMX grant, no such variant, or no extension)."""
    ext = build.load_extension()
    return "native kernels unavailable" if ext is None else str(ext.prefill_isa_status(isa))


def prefill_isa(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """The prefill variant :func:`prefill_attention` runs by default for inputs of ``dtype``:
    the one ``SPARSEKV_KERNEL_ISA`` names if this CPU runs it and it takes ``dtype`` (with a
    warning the fastest where the CPU does not run it; ``None``, so PyTorch, where it names a
    variant without a prefill kernel), else the fastest; ``None`` without the extension or for
    another dtype."""
    if dtype not in PREFILL_DTYPES:
        return None
    isas = prefill_isas(dtype)
    forced = kernel_isa_setting()  # read per call: tests set it
    if forced in isas:
        return forced
    if forced in NO_PREFILL_VARIANTS:
        return None
    if forced and forced not in prefill_isas():  # not run here, or no variant at all
        _warn_unusable_prefill_isa(forced)
    return isas[0] if isas else None


@functools.cache
def _warn_unusable_prefill_isa(name: str) -> None:
    warnings.warn(
        f"{ISA_ENV}={name!r} is not a prefill kernel variant this CPU runs "
        f"({prefill_isa_status(name)}); using the default",
        RuntimeWarning,
        stacklevel=5,
    )


def supports_prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None
) -> bool:
    """True when :func:`prefill_attention` takes these tensors: CPU query ``[num_heads,
    num_queries, head_dim]`` and key (and value, if given) ``[num_kv_heads, num_keys,
    head_dim]``, all bf16 or all fp32, with ``num_queries <= num_keys``, ``num_heads`` a
    multiple of ``num_kv_heads`` (at most 64 query heads per KV head), ``head_dim`` a multiple
    of 32, no autograd, and a prefill kernel variant for the dtype (:func:`prefill_isa`).
    """
    tensors = (query, key) if value is None else (query, key, value)
    if any(t.device.type != "cpu" or t.dtype != query.dtype or t.dim() != 3 for t in tensors):
        return False
    if value is not None and value.shape != key.shape:
        return False
    num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys, key_dim = key.shape
    if (
        key_dim != head_dim
        or head_dim == 0
        or head_dim % 32
        or num_kv_heads == 0
        or num_heads % num_kv_heads
        or num_heads // num_kv_heads > 64
        or num_queries > num_keys
        or any(t.requires_grad for t in tensors)
    ):
        return False
    return prefill_isa(query.dtype) is not None


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    isa: str | None = None,
    qk_int8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the last ``num_queries`` of ``num_keys`` positions, with the
    log-sum-exp of every query row; the semantics of ``torch_ref.attention_with_lse`` without
    soft-cap (query row ``i`` sits at key ``p = num_keys - num_queries + i`` and sees keys
    ``j <= p``, with a sliding window ``w`` only ``j > p - w``; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``). A window skips the key blocks outside it, so a local
    layer costs ``O(num_queries x w)``.

    Args:
        query: ``[num_heads, num_queries, head_dim]`` bf16 or fp32 (any strides).
        key, value: ``[num_kv_heads, num_keys, head_dim]`` of the query's dtype,
            ``num_keys >= num_queries``.
        scale: softmax scale, positive.
        sliding_window: keys each row sees, itself included (Gemma 3 local layers); ``None``:
            all earlier keys.
        isa: prefill variant (default :func:`prefill_isa` for the dtype; see
            :func:`prefill_isas`); fp32 runs on :data:`FP32_VARIANTS` only.
        qk_int8: logits from int8 codes where :func:`prefill_qk_int8_runs` for the dtype,
            variant and ``head_dim`` (ignored elsewhere, e.g. ``head_dim`` over 256): the keys
            minus their channel means over the ``num_keys`` keys, and the queries, quantized
            per row to ``round(x * 127 / max|x|)``; the products summed exactly in int32,
            scaled by both rows' ``max|x| / 127``. The lse adds ``scale * q·mean`` back, so it
            is the lse of these logits unsmoothed. A key or query row with a NaN or inf makes
            its logits NaN; a channel whose mean is not finite is not smoothed.

    Returns:
        out ``[num_heads, num_queries, head_dim]`` (the query's dtype), lse ``[num_heads,
        num_queries]`` fp32 (natural log). bf16: logits are exact bf16 products summed in fp32
        (with ``qk_int8``, the int8 products above);
        on ``avx512_amx`` and ``avx512_bf16`` probabilities enter the value product rounded to
        bf16, on the fp32 variants in fp32, and the output is rounded to bf16. fp32: fp32
        throughout (within 1e-5 of the fp32 reference at unit-scale inputs).

    Raises:
        ValueError: ``sliding_window`` or ``scale`` is not positive (or ``scale`` not finite).
        RuntimeError: the extension or the variant is unavailable, or it rejects the arguments
            (see :func:`supports_prefill`; fp32 on a bf16-only variant).
    """
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    check_softmax_scale(scale)
    window = 0 if sliding_window is None else int(sliding_window)
    ext = _extension()
    variant = isa or prefill_isa(query.dtype) or PREFILL_ISA
    int8 = qk_int8 and prefill_qk_int8_runs(query.dtype, variant, query.shape[-1])
    return ext.prefill_attention(query, key, value, float(scale), window, variant, int8)
