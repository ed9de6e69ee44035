"""Prefill-sized matmuls of ``--weight-dtype w8a8`` layers: ``x``'s rows quantized to int8
(one dynamic scale each) and multiplied with per-channel int8 weights in oneDNN's int8 GEMM,
between two native passes (``csrc/int8_rows_*``: AVX-512 on the variants with int8 dot
products, AVX2 on the others).

oneDNN's int8 GEMM on CPUs without VNNI sums pairs of u8 x s8 products in saturating int16
(``vpmaddubsw``): exact only while the weight codes stay within +-64, so ``w8a8`` weights are
quantized to 7 bits there (:func:`int8_gemm_saturates`, ``apply.py``).
"""

from __future__ import annotations

import functools

import torch

from sparsekv.models.quant import ops
from sparsekv.models.quant.formats import PackedTensor

# The variants with the passes of :func:`int8_rows_matmul`: on them, prefill-sized matmuls on
# int8 weights quantize x's rows to int8 and multiply in int32.
INT8_ROWS_VARIANTS = ("avx512_amx", "avx512_vnni", "avx2")
# Largest weight code of ``w8a8`` layers where the int8 GEMM saturates: u8 x s8 pair sums of
# at most 2 * 255 * 64 fit int16 (63: symmetric codes).
SATURATING_GEMM_CODE_MAX = 63
# Fewest output features a layer takes the path with: oneDNN's AVX-512 (no VNNI) int8 GEMM
# swaps its operands for a single output column, which puts the weight codes on the unsigned
# side where even 7-bit ones saturate; every decoder linear has hundreds.
INT8_ROWS_MIN_OUTPUTS = 16
# Decode-sized inputs (up to ``ops.kernel_max_rows`` rows) take the path too from this many rows
# on, per variant: there oneDNN's int8 GEMM outruns the packed kernels (which dequantize the
# weight and accumulate fp32 on full-precision x). One AMD EPYC Zen 4 core, SmolLM2's w8a8
# layers (960 / 576 / 3072 x 576, 576 x 1536), weights in cache: avx512_vnni 2.5-4x faster from
# 2 rows, 4-5x at 16; avx2 (forced, AVX2 limits on the libraries too) 1.5x at 4 rows, ~3x at 16.
# A lone row stays on the kernels: once the weights stream from memory both routes run a
# batch-1 decode step alike (44 tok/s either way on Zen 4), and the kernels keep x unquantized.
# The output head (49152 x 576), which the kernels stream better at few rows: int8 faster from
# ~6 rows (avx512_vnni), between 4 and 16 (avx2). avx512_amx keeps the kernels (not measured).
DECODE_MIN_ROWS = {"avx512_vnni": 2, "avx2": 2}
DECODE_MIN_ROWS_LARGE = {"avx512_vnni": 6, "avx2": 8}
# Rows of x per int8 product of that path: a chunk's int32 products stay in cache for the
# scaling pass (SmolLM2's 3072 x 576 gate / up at 4000 rows, 2 threads, Zen 4: 22.9 ms in
# chunks of 512 against 31.0 ms at once, the int8 product alone).
INT8_CHUNK_ROWS = 512


def int8_rows_runs(x: torch.Tensor) -> bool:
    """Whether :func:`int8_rows_matmul` runs ``x`` now.

    Args:
        x: the activations, ``[rows, in_features]``.

    Returns:
        True for a CPU fp32 or bf16 ``x`` with the extension loaded and the variant in use
        (forced or the fastest) one of :data:`INT8_ROWS_VARIANTS`.
    """
    return runs_on(x) is not None


def runs_on(x: torch.Tensor) -> str | None:
    """The variant :func:`int8_rows_matmul` runs ``x`` on now, or ``None`` where it does not
    (:func:`int8_rows_runs`)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    ext, variant = ops.resolved_kernels()
    return variant if ext is not None and variant in INT8_ROWS_VARIANTS else None


def takes_decode_rows(num_rows: int, large_weight: bool, variant: str | None = None) -> bool:
    """Whether :func:`int8_rows_matmul` should take ``num_rows`` rows of x that the packed
    kernels could (:data:`DECODE_MIN_ROWS`, :data:`DECODE_MIN_ROWS_LARGE` for a weight past
    ``ops.LARGE_DENSE_BYTES`` as bf16) on ``variant`` (default: the one in use)."""
    variant = ops.resolved_kernels()[1] if variant is None else variant
    least = (DECODE_MIN_ROWS_LARGE if large_weight else DECODE_MIN_ROWS).get(variant)
    return least is not None and num_rows >= least


@functools.cache
def int8_gemm_saturates() -> bool:
    """Whether ``torch._int_mm`` (oneDNN's int8 GEMM on the CPU) loses products of full-range
    int8 codes here: True on CPUs without VNNI, where oneDNN sums pairs of u8 x s8 products in
    saturating int16 (``vpmaddubsw``); weights for :func:`int8_rows_matmul` must then keep
    their codes within +-64 (``apply.py`` quantizes them to +-:data:`SATURATING_GEMM_CODE_MAX`).
    Probed once per process with one product whose exact value it must return
    (``127 * 127 * 64``), the weight operand laid out as the path passes it (a transposed view
    of row-major codes)."""
    a = torch.full((80, 64), 127, dtype=torch.int8)
    b = torch.full((64, 64), 127, dtype=torch.int8).t()
    return bool((torch._int_mm(a, b) != 127 * 127 * 64).any())


# Gated activations the int8 path applies in its scaling pass (``activation``).
INT8_ROWS_ACTIVATIONS = ("silu", "gelu_tanh")


def int8_rows_matmul(
    x: torch.Tensor,
    weight: PackedTensor,
    bias32: torch.Tensor | None = None,
    activation: str = "",
) -> torch.Tensor:
    """``x W^T + bias`` for an ``int8`` weight (per output channel) with ``x``'s rows quantized
    to int8 too: W8A8 with one dynamic scale per row, as vLLM's CPU int8 linears and the
    per-token variant of SmoothQuant (Xiao et al., 2023) do.

    Per row ``r``: ``s_r = max|x_r| / 127``, codes ``round(x_r * 127 / max|x_r|)`` (nearest
    even); ``y[r, c] = (codes_r . q_c) * s_r * w_c + bias[c]``, the dot product exact in int32
    (oneDNN's int8 GEMM through ``torch._int_mm``; where :func:`int8_gemm_saturates`, only for
    weight codes within +-:data:`SATURATING_GEMM_CODE_MAX`), the scaling in fp32, rounded once
    to ``x``'s dtype. Rows go in chunks of at most :data:`INT8_CHUNK_ROWS` (fewer for a wide
    weight: ~8 MiB of int32 products per chunk).

    With an ``activation`` (``silu``, ``gelu_tanh``) the weight is a fused gate / up projection
    (gate rows, then up rows) and the result is ``act(gate) * up``, applied in the scaling
    pass to the fp32 values (one rounding instead of two, and no ``[rows, 2n]`` intermediate).

    Args:
        x: ``[rows, in_features]`` fp32 or bf16 on the CPU, last dimension contiguous.
        weight: an ``int8`` packed weight ``[out_features, in_features]``.
        bias32: fp32 ``[out_features]`` or ``None``.
        activation: ``""`` (none) or one of :data:`INT8_ROWS_ACTIVATIONS`.

    Returns:
        ``[rows, out_features]`` in ``x``'s dtype (``[rows, out_features / 2]`` with an
        activation).

    Raises:
        RuntimeError: the variant in use has no passes for this path (check
            :func:`int8_rows_runs`), an unknown activation, an odd ``out_features`` with one,
            or shapes / dtypes that do not match.
    """
    ext, variant = ops.resolved_kernels()
    if ext is None:
        raise RuntimeError("int8_rows_matmul needs the native packed-weight kernels")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return ext.int8_rows_matmul(
        x, weight.data, weight.in_features, bias32, INT8_CHUNK_ROWS, variant, activation
    )
