"""Eager PyTorch versions of the fused ops: the fallback when the extension is unavailable, and
the oracle of the tests. Each rounds to the input dtype exactly where the unfused model code did.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """Root-mean-square norm (Zhang & Sennrich 2019) in fp32: ``x * rsqrt(mean(x^2) + eps) * w``
    with ``w = weight`` (or ``1 + weight``: ``unit_offset``, Gemma), cast back to ``x``'s dtype.

    Args:
        x: ``[..., hidden_size]``.
        weight: ``[hidden_size]``.
    """
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight.float()
    if unit_offset:
        scale = 1.0 + scale
    return (x32 * scale).to(dtype)


def add_rms_norm(
    hidden: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden + delta, rms_norm(hidden + delta))``, the sum in ``hidden``'s dtype."""
    hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps, unit_offset)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up`` ``[..., 2 * n]`` (gate first) -> ``[..., n]``,
    both steps in the input dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    # The activation on a contiguous copy: on a strided half it runs ~3x slower on CPU.
    gate = nn.functional.silu(gate.contiguous(), inplace=True)
    return gate * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's ``gelu_tanh(gate) * up``; layout and rounding as :func:`silu_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.gelu(gate.contiguous(), approximate="tanh") * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by per-token ``cos`` / ``signed_sin``
    (``[num_tokens, 1, head_dim]``, from ``RotaryEmbedding.cos_sin``): HF's
    ``x * cos + rotate_half(x) * sin``, where ``rotate_half(x) = cat(-x2, x1)``, computed as
    ``x * cos + cat(x2, x1) * signed_sin``. Returns a new tensor."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
