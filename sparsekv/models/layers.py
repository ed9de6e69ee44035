"""Building blocks of the decoder: RMSNorm, gated MLP (and the rotary embedding, re-exported).

Their elementwise math runs through ``sparsekv.models.fused`` (native kernels, eager fallback).
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekv.models.fused import ops as fused
from sparsekv.models.fused.reference import apply_rotary
from sparsekv.models.quant.linear import QuantizedLinear
from sparsekv.models.rotary import RotaryEmbedding

__all__ = ["GatedMLP", "RMSNorm", "RotaryEmbedding", "apply_rotary"]


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32.

    Args:
        hidden_size: last-dimension size.
        eps: added to the mean square.
        unit_offset: scale by ``1 + weight`` (Gemma's convention) instead of ``weight``.
    """

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., hidden_size]`` (any strides) -> same shape and dtype, contiguous."""
        return fused.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add_and_norm(
        self, residual: torch.Tensor | None, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused with this norm: ``(residual + delta, norm(residual + delta))``,
        the sum rounded to the input dtype first as the two eager steps do.

        Args:
            residual: ``[num_tokens, hidden_size]`` residual stream, or ``None`` when ``delta``
                is the stream itself (the first layer's input).
            delta: ``[num_tokens, hidden_size]`` to add, same dtype.
        """
        if residual is None:
            return delta, self(delta)
        return fused.add_rms_norm(residual, delta, self.weight, self.eps, self.unit_offset)


# ``[..., 2 * intermediate]`` (gate, then up) -> ``act(gate) * up``, by activation name.
GATED_ACTIVATIONS = {"silu": fused.silu_mul, "gelu_tanh": fused.gelu_tanh_mul}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul.

    Args:
        hidden_size, intermediate_size: layer widths.
        activation: ``silu`` (SwiGLU, Llama) or ``gelu_tanh`` (GeGLU, Gemma).
        bias: linear biases.

    Raises:
        ValueError: an unknown activation.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False
    ) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(
                f"model: unknown MLP activation {activation!r} "
                f"(expected one of {sorted(GATED_ACTIVATIONS)})"
            )
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[num_tokens, hidden_size]`` -> same shape."""
        # act(gate) * up: [T, I]; a w8a8 projection applies it inside its int8 path
        gate_up = self.gate_up_proj
        quantized = isinstance(gate_up, QuantizedLinear)
        hidden = gate_up.gated_forward(x, self.activation) if quantized else None
        if hidden is None:
            hidden = GATED_ACTIVATIONS[self.activation](self.gate_up_proj(x))
        return self.down_proj(hidden)
