"""Matmuls with packed weights: the native kernels (``csrc/``) where they apply, else a
dense matmul on the weight dequantized in PyTorch.

Decode-sized inputs (1 to :data:`SMALL_M_MAX_ROWS` rows) go through the native kernels, which
read the packed weight once and dequantize it in registers (one row: the GEMV; more: a tiled
GEMM that dequantizes each tile of 4 weight rows once for all rows of ``x``). Larger inputs
(prefill) dequantize the weight in slices of :data:`DEQUANT_SLICE_ROWS` output features and
multiply densely in ``x``'s dtype, so they keep the dense path's speed.

``SPARSEKV_KERNEL_ISA`` forces a variant as for the other native kernels (``avx2`` or
``generic``); naming one this CPU does not run, or one these kernels do not have, uses the
fastest with a warning.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from sparsekv.models.quant import build
from sparsekv.models.quant.formats import FORMATS, PackedTensor, dequantize_reference

ISA_ENV = "SPARSEKV_KERNEL_ISA"
# Rows of x up to this go through the native kernels; more dequantize tiles for a dense matmul.
SMALL_M_MAX_ROWS = 64
# Output features dequantized at once on the dense path (bounds the temporary: 4096 x 1536 fp32
# is 24 MiB).
DEQUANT_SLICE_ROWS = 4096


def available_isas() -> tuple[str, ...]:
    """Variants of the packed-weight kernels this CPU runs, fastest first (empty without the
    extension)."""
    ext = build.load_extension()
    return tuple(str(ext.available_isas()).split(",")) if ext is not None else ()


def kernel_isa() -> str:
    """The variant to run: ``SPARSEKV_KERNEL_ISA`` where it names one this CPU runs, else
    ``""`` (the fastest). Read per call: tests set it."""
    forced = os.environ.get(ISA_ENV, "").strip()
    if not forced:
        return ""
    if forced in available_isas():
        return forced
    _warn_unusable(forced)
    return ""


@functools.cache
def _warn_unusable(name: str) -> None:
    warnings.warn(
        f"{ISA_ENV}={name!r} is not a packed-weight kernel variant this CPU runs "
        f"({', '.join(available_isas())}); using the fastest",
        RuntimeWarning,
        stacklevel=4,
    )


def matmul(x: torch.Tensor, parts: list[PackedTensor]) -> torch.Tensor:
    """``x W^T`` for ``W`` the row concatenation of ``parts``, in fp32.

    Args:
        x: ``[rows, in_features]``, any float dtype (cast to fp32).
        parts: packed weights with ``x``'s ``in_features``, possibly of different formats.

    Returns:
        fp32 ``[rows, sum of out_features]``.
    """
    ext = build.load_extension()
    rows = x.shape[0]
    if ext is None or rows > SMALL_M_MAX_ROWS:
        return torch.cat([_dense(x.float(), part) for part in parts], dim=-1)
    xf = x.to(torch.float32).contiguous()
    out = torch.empty(rows, sum(part.shape[0] for part in parts), dtype=torch.float32)
    isa, col = kernel_isa(), 0
    for part in parts:
        ext.matmul_(xf, part.data, FORMATS[part.format].code, part.in_features, out, col, isa)
        col += part.shape[0]
    return out


def dense_matmul(x: torch.Tensor, parts: list[PackedTensor]) -> torch.Tensor:
    """``x W^T`` in ``x``'s dtype on weight slices dequantized to that dtype (prefill)."""
    return torch.cat([_dense(x, part) for part in parts], dim=-1)


def _dense(x: torch.Tensor, part: PackedTensor) -> torch.Tensor:
    pieces = []
    for start in range(0, part.shape[0], DEQUANT_SLICE_ROWS):
        piece = part.with_rows(part.data[start : start + DEQUANT_SLICE_ROWS])
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
