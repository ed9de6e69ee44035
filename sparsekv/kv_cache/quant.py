"""KV-cache quantization formats: int8, fp8 (e4m3) and KIVI-style int4.

Every format stores a value as ``code * scale`` (int4: ``code * scale + zero``) with the scale
beside the page:

- ``int8``: symmetric, one fp32 scale per (page, K/V, head, slot): ``scale = absmax / 127``,
  codes in ``[-127, 127]``. Relative error per element at most ``0.5 / 127`` of its row's absmax.
- ``fp8``: ``float8_e4m3fn`` codes, one fp32 scale per (page, K/V, head, slot):
  ``scale = absmax / 448`` (the format's largest finite value), so the row's absmax maps to the
  top of the range; 3 mantissa bits give a relative error of at most 2^-4 per element (plus
  the subnormal floor ``2^-9 * scale``).
- ``int4`` (KIVI, Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
  Cache"): asymmetric 4-bit codes ``[0, 15]`` with ``scale = (max - min) / 15`` and
  ``zero = min``; **keys per channel** (statistics over the ``block_size`` slots of one page and
  one head, so outlier channels keep their own range) and **values per token** (over
  ``head_dim``). Two codes per byte along ``head_dim`` (even element in the low nibble). A
  page's keys can only be quantized once the page is full, so the most recent
  ``< block_size`` tokens of every (request, layer) stay at full precision outside the pool,
  KIVI's residual.

Functions take and return plain tensors; ``[..., d]`` means any leading shape.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "int4")
INT8_MAX = 127.0
FP8_MAX = 448.0
INT4_LEVELS = 15.0
FP8_DTYPE = torch.float8_e4m3fn
_TINY = 1e-12


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8.

    Args:
        x: ``[..., d]`` float.

    Returns:
        codes ``[..., d]`` int8 and scales ``[...]`` fp32 (``x ~= codes * scales[..., None]``).
    """
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(_TINY) / INT8_MAX
    codes = torch.round(x / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` in ``dtype``; shapes as :func:`quantize_int8`'s results."""
    return (codes.float() * scale[..., None]).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scaled float8_e4m3fn.

    Args:
        x: ``[..., d]`` float.

    Returns:
        codes ``[..., d]`` float8_e4m3fn and scales ``[...]`` fp32.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(_TINY) / FP8_MAX
    codes = (x / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` in ``dtype``; shapes as :func:`quantize_fp8`'s results."""
    return (codes.float() * scale[..., None]).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` integer codes in ``[0, 15]`` -> ``[..., d // 2]`` uint8 (even element in
    the low nibble). ``d`` must be even."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., d // 2]`` uint8 -> ``[..., d]`` uint8 codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _asymmetric(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low = x.amin(dim=dim, keepdim=True)
    scale = ((x.amax(dim=dim, keepdim=True) - low) / INT4_LEVELS).clamp_min(_TINY)
    # Round the statistics to their fp16 storage first so codes match what is decoded.
    low = low.half().float()
    scale = scale.half().float().clamp_min(2.0**-24)
    codes = torch.round((x - low) / scale).clamp_(0, INT4_LEVELS)
    return codes, scale, low


def quantize_int4_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI keys: per-channel asymmetric int4 over a group of slots.

    Args:
        x: ``[..., n, d]`` float, ``n`` slots (one page) of one head.

    Returns:
        packed ``[..., n, d // 2]`` uint8, scale ``[..., d]`` fp16, zero ``[..., d]`` fp16
        (``x ~= code * scale + zero`` per channel).
    """
    codes, scale, low = _asymmetric(x.float(), dim=-2)
    return pack_int4(codes), scale.squeeze(-2).half(), low.squeeze(-2).half()


def quantize_int4_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI values: per-token asymmetric int4.

    Args:
        x: ``[..., d]`` float.

    Returns:
        packed ``[..., d // 2]`` uint8, scale ``[...]`` fp16, zero ``[...]`` fp16.
    """
    codes, scale, low = _asymmetric(x.float(), dim=-1)
    return pack_int4(codes), scale.squeeze(-1).half(), low.squeeze(-1).half()


def dequantize_int4_keys(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[..., n, d // 2]`` packed keys with ``[..., d]`` scale/zero -> ``[..., n, d]``."""
    codes = unpack_int4(packed).float()
    return (codes * scale.float()[..., None, :] + zero.float()[..., None, :]).to(dtype)


def dequantize_int4_values(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[..., d // 2]`` packed values with ``[...]`` scale/zero -> ``[..., d]``."""
    codes = unpack_int4(packed).float()
    return (codes * scale.float()[..., None] + zero.float()[..., None]).to(dtype)
