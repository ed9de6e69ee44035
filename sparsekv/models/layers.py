"""Building blocks shared by the model files: RMSNorm, rotary embedding, gated MLP.

Their elementwise math runs through ``sparsekv.models.fused`` (native kernels, eager fallback).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from sparsekv.models.fused import ops as fused
from sparsekv.models.fused.reference import apply_rotary

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


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer), HF's rotate-half layout.

    Frequencies come from transformers' RoPE initialisers, so llama3 / linear / dynamic scaling
    follow the config exactly.

    Args:
        config: a transformers config (its ``rope_parameters`` select the scaling).
        head_dim: rotated dimension.
        layer_type: key into ``config.rope_parameters`` when it holds one entry per layer type
            (Gemma 3: ``full_attention`` / ``sliding_attention``).
    """

    def __init__(self, config, head_dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        self._args = (config, head_dim, layer_type)
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.attention_scaling = 1.0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute the frequencies, e.g. after building the module on the meta device."""
        config, head_dim, layer_type = self._args
        params = dict(getattr(config, "rope_parameters", None) or {})
        if layer_type is not None and layer_type in params:
            params = dict(params[layer_type])
        else:
            layer_type = None
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
            inv_freq, scaling = 1.0 / (base**exponent), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
        with torch.no_grad():
            self.inv_freq = inv_freq.float().to(self.inv_freq.device)
        self.attention_scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``positions``: ``[num_tokens]`` int64 -> ``(cos, signed_sin)``, each
        ``[num_tokens, 1, head_dim]`` in ``dtype``, as :func:`apply_rotary` takes them.

        ``signed_sin`` is ``sin`` with its first half negated, which folds rotate-half's sign
        into the table once per step instead of once per layer.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.attention_scaling).repeat(1, 2)
        sin = freqs.sin() * self.attention_scaling
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]


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
        act_mul = GATED_ACTIVATIONS[self.activation]
        return self.down_proj(act_mul(self.gate_up_proj(x)))  # act(gate) * up: [T, I]
