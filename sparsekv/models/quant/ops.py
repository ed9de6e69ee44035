"""Matmuls with packed weights: the native kernels (``csrc/``) where they apply, else a
dense matmul on the weight dequantized in PyTorch.

Decode-sized inputs (1 to :func:`kernel_max_rows` rows) go through the native kernels, which
read the packed weight once and dequantize it in registers (one row: the GEMV; more: a tiled
GEMM that dequantizes each tile of 4 weight rows once for all rows of ``x``); on CPUs with
AVX512-BF16 the ``avx512_bf16`` variant multiplies bf16 ``x`` with Q4_0 / Q4_1 / Q8_0 codes
expanded to bf16 (``vdpbf16ps``, fp32 accumulation), and on CPUs with AVX512-VNNI the
``avx512_vnni`` variant quantizes bf16 ``x`` to int8 per block of 32 (as llama.cpp does for its
quantized dot products) and multiplies with integer dot products (``vpdpbusd``), fastest on
weights repacked in groups of 16 rows (:func:`repack_x16`; ``apply`` does it at load for bf16
models; the ``avx2`` variant runs the same x16 arithmetic with ``vpmaddubsw``, and on CPUs with
AMX-INT8 the ``avx512_amx`` variant runs it on tiles (``tdpbsud``) from 4 rows of ``x``, both
equal bit for bit). Larger inputs (prefill) dequantize the weight in slices of
:data:`DEQUANT_SLICE_ROWS` output features and multiply densely in ``x``'s dtype, so they keep
the dense path's speed; ``w8a8`` layers instead quantize ``x``'s rows to int8 for oneDNN's int8
GEMM on the ``avx512_amx``, ``avx512_vnni`` and ``avx2`` variants (``int8_rows``).

``SPARSEKV_KERNEL_ISA`` forces a variant as for the other native kernels (``avx512_amx``,
``avx512_vnni``, ``avx512_bf16``, ``avx2`` or ``generic``); naming one this CPU does not run, or
one these kernels do not have, uses the fastest with a warning. x16 weights run on
``avx512_amx``, ``avx512_vnni`` and ``avx2`` with bf16 ``x`` only; elsewhere (fp32 ``x``,
another variant) they take the dense path.
"""

from __future__ import annotations

import contextvars
import functools
import warnings

import torch

from sparsekv.env_flags import KERNEL_ISA, kernel_isa_setting
from sparsekv.ext_cache import ExtensionScope
from sparsekv.models.quant import build
from sparsekv.models.quant.formats import (
    FORMATS,
    X16_FORMATS,
    PackedTensor,
    dequantize_reference,
)

ISA_ENV = KERNEL_ISA
# Rows of x up to this go through the native kernels; more dequantize tiles for a dense matmul.
SMALL_M_MAX_ROWS = 64
# ... except on a weight whose bf16 copy exceeds LARGE_DENSE_BYTES (an output head): the dense
# path streams that copy through memory on every call, and the kernels stay the faster route
# up to LARGE_M_MAX_ROWS rows (SmolLM2's 49152 x 576 Q8_0 head, 2 threads, Zen 4: 16.2 against
# 32.7 ms at 80 rows, 24.7 against 21.1 at 128).
LARGE_DENSE_BYTES = 16 << 20
LARGE_M_MAX_ROWS = 96
# Weights in an x16 group layout (the int8 kernels of X16_VARIANTS) stay faster than dequantizing
# up to about 128 rows on every shape (measured with avx512_vnni on SmolLM2's shapes, 2 threads,
# Zen 5, kernel against dense: gate + up 3072 x 576 825 against 909 us at 128 rows, 1052
# against 1036 at 160; the 49152 x 576 Q8_0 head 13.6 against 17.5 ms at 128).
X16_MAX_ROWS = 128
# Output features dequantized at once on the dense path (bounds the temporary: 4096 x 1536 fp32
# is 24 MiB).
DEQUANT_SLICE_ROWS = 4096


def is_x16(parts: list[PackedTensor]) -> bool:
    """True when every part is in an x16 group layout (:func:`repack_x16`)."""
    return all(part.format in _X16_NAMES for part in parts)


def kernel_max_rows(out_features: int, in_features: int, x16: bool = False) -> int:
    """Most rows of ``x`` a packed ``[out_features, in_features]`` weight multiplies through the
    native kernels (:data:`SMALL_M_MAX_ROWS`, :data:`LARGE_M_MAX_ROWS` for a weight whose bf16
    copy exceeds :data:`LARGE_DENSE_BYTES`, :data:`X16_MAX_ROWS` for one in an x16 group layout
    (``x16``)); more rows take the dense path."""
    if x16:
        return X16_MAX_ROWS
    large = 2 * out_features * in_features > LARGE_DENSE_BYTES
    return LARGE_M_MAX_ROWS if large else SMALL_M_MAX_ROWS


def available_isas() -> tuple[str, ...]:
    """Variants of the packed-weight kernels this CPU runs, fastest first (empty without the
    extension)."""
    ext = build.load_extension()
    return tuple(str(ext.available_isas()).split(",")) if ext is not None else ()


def kernel_isa() -> str:
    """The variant to run: ``SPARSEKV_KERNEL_ISA`` where it names one this CPU runs, else
    ``""`` (the fastest). The environment is read per call (tests set it); the choice is cached
    per setting."""
    return _isa_for(build.load_extension(), kernel_isa_setting())


@functools.cache
def _isa_for(ext, setting: str) -> str:
    # Keyed on the extension too: without it (disabled, failed build) no variant is runnable.
    forced = setting.strip()
    if not forced:
        return ""
    if forced in available_isas():
        return forced
    _warn_unusable(forced)
    return ""


# the variants with kernels for the x16 group layouts
X16_VARIANTS = ("avx512_amx", "avx512_vnni", "avx2")
_X16_NAMES = frozenset(X16_FORMATS.values())
_X16_CODES = frozenset(FORMATS[name].code for name in _X16_NAMES)


def x16_runs() -> bool:
    """Whether bf16 matmuls would run the x16 kernels now: the extension is loaded and the
    variant in use (forced or the fastest) is one of :data:`X16_VARIANTS`."""
    return bool(available_isas()) and _x16_variant(kernel_isa())


def _x16_variant(isa: str) -> bool:
    """Whether ``isa`` (``""``: the fastest) has x16 kernels."""
    return (isa or _fastest()) in X16_VARIANTS


def repack_x16(weight: PackedTensor) -> PackedTensor:
    """``weight`` (Q4_0 / Q4_1 / Q8_0, out_features a multiple of 16) in its x16 group layout
    (native; dequantizes to the same values).

    Raises:
        ValueError: another format, out_features not a multiple of 16, or no extension.
    """
    if weight.format not in X16_FORMATS or weight.shape[0] % 16:
        raise ValueError(
            f"weight: only q4_0 / q4_1 / q8_0 with a multiple of 16 rows repack to x16, got "
            f"{weight.format} with {weight.shape[0]} rows"
        )
    ext = build.load_extension()
    if ext is None:
        raise ValueError("weight: repacking to x16 needs the native packed-weight kernels")
    data = ext.repack_x16(weight.data, FORMATS[weight.format].code, weight.in_features)
    return PackedTensor(X16_FORMATS[weight.format], weight.in_features, data)


def native_scope() -> ExtensionScope:
    """Within the ``with`` block, packed matmuls use the extension and the variant resolved on
    entry instead of reading the environment and the build's state on every call (a decode step
    makes ~120 of them); a disabled or failed extension resolves to the PyTorch fallback for the
    whole block. Entering builds nothing: before the extension has been loaded in this process
    (a model without packed weights never loads it), the block reads per call as outside any
    scope."""
    return ExtensionScope(_scope, _scope_value)


def _scope_value() -> tuple | None:
    if not build.is_loaded():
        return None
    ext = build.load_extension()
    return ext, kernel_isa() if ext is not None else ""


# (extension, variant) resolved by the innermost native_scope; None outside any (or before the
# extension was loaded).
_scope: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "sparsekv_quant_scope", default=None
)


def resolved_kernels() -> tuple:
    """``(extension or None, variant)`` in effect now: the enclosing :func:`native_scope`'s,
    else read now; the variant is the forced one or the fastest (``""`` without the
    extension)."""
    ext, isa = _resolved()
    return ext, (isa or _fastest()) if ext is not None else ""


def _resolved() -> tuple:
    """``(extension or None, variant)``: the enclosing :class:`native_scope`'s, else read now."""
    scoped = _scope.get()
    if scoped is not None:
        return scoped
    ext = build.load_extension()
    return ext, kernel_isa() if ext is not None else ""


@functools.cache
def _warn_unusable(name: str) -> None:
    warnings.warn(
        f"{ISA_ENV}={name!r} is not a packed-weight kernel variant this CPU runs "
        f"({', '.join(available_isas())}); using the fastest",
        RuntimeWarning,
        stacklevel=4,
    )


# One native call of a packed matmul: (packed rows uint8 [n, row_bytes], format code,
# in_features, n). ``QuantizedLinear`` builds its tuple of these once.
KernelPart = tuple[torch.Tensor, int, int, int]


def kernel_parts(parts: list[PackedTensor]) -> tuple[KernelPart, ...]:
    """The native calls that compute ``parts``, one per part."""
    return tuple((p.data, FORMATS[p.format].code, p.in_features, p.shape[0]) for p in parts)


def matmul(
    x: torch.Tensor, parts: list[PackedTensor], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + bias`` for ``W`` the row concatenation of ``parts``, accumulated in fp32.

    fp32 and bf16 ``x`` go to the kernels as they are (bf16 runs the ``avx512_bf16`` kernels
    on Q4_0 / Q4_1 / Q8_0 parts, and is converted to fp32 inside the op for the others); the
    result is rounded once to ``x``'s dtype after the bias is added in fp32. Other dtypes are
    cast to fp32 and the result back.

    Args:
        x: ``[rows, in_features]``, any float dtype.
        parts: packed weights with ``x``'s ``in_features``, possibly of different formats.
        bias: ``[sum of out_features]`` or ``None``.

    Returns:
        ``[rows, sum of out_features]`` in ``x``'s dtype.
    """
    ext, _ = _resolved()
    out_features = sum(part.shape[0] for part in parts)
    max_rows = kernel_max_rows(out_features, parts[0].in_features, is_x16(parts))
    if ext is None or x.shape[0] > max_rows:
        y = torch.cat([_dense(x.float(), part) for part in parts], dim=-1)
        return (y if bias is None else y + bias.float()).to(x.dtype)
    bias32 = None if bias is None else bias.to(torch.float32)  # no copy for an fp32 bias
    return matmul_kernel_parts(x, kernel_parts(parts), out_features, bias32)


def matmul_kernel_parts(
    x: torch.Tensor,
    calls: tuple[KernelPart, ...],
    out_features: int,
    bias32: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`matmul`'s native path on prepared calls (:func:`kernel_parts`): one kernel call
    per entry, each writing its columns of one output.

    Args:
        x: ``[rows, in_features]``, any float dtype (the kernels take any row count; callers
            send at most :func:`kernel_max_rows`).
        calls: the weight's row blocks in output order; their ``n`` sum to ``out_features``.
        out_features: columns of the result.
        bias32: fp32 ``[out_features]`` or ``None``.

    Returns:
        ``[rows, out_features]`` in ``x``'s dtype; without the extension the PyTorch fallback.
    """
    ext, isa = _resolved()
    if ext is None:
        parts = [PackedTensor(_FORMAT_NAMES[code], k, data) for data, code, k, _ in calls]
        return matmul(x, parts, bias32)
    native = x.dtype in (torch.float32, torch.bfloat16)
    xk = (x if native else x.float()).contiguous()
    out = torch.empty(xk.shape[0], out_features, dtype=xk.dtype)
    op, col = ext.matmul_.default, 0  # the single overload: skips overload resolution
    x16_kernels = None  # resolved on the first x16 call only
    for data, code, in_features, n in calls:
        part_bias = None if bias32 is None else bias32[col : col + n]
        if code in _X16_CODES:
            if x16_kernels is None:
                x16_kernels = xk.dtype == torch.bfloat16 and _x16_variant(isa)
            if not x16_kernels:  # fp32 x or another variant: no kernel reads this layout
                part = PackedTensor(_FORMAT_NAMES[code], in_features, data)
                y = _dense(xk.float(), part)
                out[:, col : col + n] = y if part_bias is None else y + part_bias
                col += n
                continue
        op(xk, data, code, in_features, out, col, isa, part_bias)
        col += n
    return out if native else out.to(x.dtype)


@functools.cache
def _fastest() -> str:
    runs = available_isas()
    return runs[0] if runs else ""


_FORMAT_NAMES = {f.code: name for name, f in FORMATS.items()}


def dense_matmul(x: torch.Tensor, parts: list[PackedTensor]) -> torch.Tensor:
    """``x W^T`` in ``x``'s dtype on weight slices dequantized to that dtype (prefill)."""
    return torch.cat([_dense(x, part) for part in parts], dim=-1)


def _dense(x: torch.Tensor, part: PackedTensor) -> torch.Tensor:
    pieces = []
    step = DEQUANT_SLICE_ROWS // FORMATS[part.format].group_rows  # rows of the packed tensor
    for start in range(0, part.data.shape[0], step):
        piece = part.with_rows(part.data[start : start + step])
        pieces.append(torch.nn.functional.linear(x, dequantize(piece).to(x.dtype)))
    return torch.cat(pieces, dim=-1)


def dequantize(weight: PackedTensor, isa: str | None = None) -> torch.Tensor:
    """``weight`` as dense fp32 ``[out_features, in_features]`` (native where available)."""
    ext = build.load_extension()
    if ext is None:
        return dequantize_reference(weight)
    code = FORMATS[weight.format].code
    return ext.dequantize(
        weight.data, code, weight.in_features, kernel_isa() if isa is None else isa
    )
