"""Rotary position embedding (Su et al. 2021, RoFormer) in HF's rotate-half layout.

Frequencies come from transformers' RoPE initialisers, so ``llama3`` / ``linear`` / ``yarn`` /
``longrope`` / ``dynamic`` scaling follow the config exactly. Two of them change with the
sequence length in transformers (``dynamic`` recomputes its base past the original context,
``longrope`` switches from its short to its long factors there), which a KV cache cannot follow
(cached keys keep their old rotation). As vLLM does, the factors are chosen once here from the
longest sequence the engine serves (``max_model_len``): past the original context the long /
rescaled ones, else the original ones. Prompts that lie wholly on the side of the switch the
engine chose match transformers exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Scalings whose factors depend on the sequence length in transformers.
LENGTH_DEPENDENT = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    """cos / sin tables of RoPE for one set of frequencies.

    Args:
        config: a transformers config (its ``rope_parameters`` select the scaling).
        head_dim: rotated dimension (``rotary_dim`` for partial rotary).
        layer_type: key into ``config.rope_parameters`` when it holds one entry per layer type
            (Gemma 3: ``full_attention`` / ``sliding_attention``).
        max_model_len: longest sequence served; picks the factors of length-dependent
            scalings (module docstring). ``None``: the original context.
    """

    def __init__(
        self, config, head_dim: int, layer_type: str | None = None, max_model_len: int | None = None
    ) -> None:
        super().__init__()
        self._args = (config, head_dim, layer_type, max_model_len)
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.attention_scaling = 1.0
        self.freq_factors: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute the frequencies, e.g. after building the module on the meta device."""
        config, head_dim, layer_type, max_model_len = self._args
        params = dict(getattr(config, "rope_parameters", None) or {})
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
        else:
            layer_type = None
        rope_type = params.get("rope_type", "default")
        # transformers' initialisers create tensors without a device: never on the meta device.
        with torch.device("cpu"):
            if rope_type == "default" or self.freq_factors is not None:
                base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
                exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
                inv_freq, scaling = 1.0 / (base**exponent), 1.0
                if self.freq_factors is not None:
                    inv_freq = inv_freq / self.freq_factors.float().cpu()
            else:
                kwargs = {"layer_type": layer_type}
                if rope_type in LENGTH_DEPENDENT:
                    kwargs["seq_len"] = _switch_length(config, params, max_model_len)
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
        with torch.no_grad():
            self.inv_freq = inv_freq.float().to(self.inv_freq.device)
        self.attention_scaling = float(scaling)

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the default frequencies by per-frequency ``factors`` ``[head_dim // 2]``
        (llama.cpp's ``rope_freqs`` tensor: Llama 3.x scaling precomputed by its converter)."""
        if factors.numel() != self.inv_freq.numel():
            raise ValueError(
                f"model: rope_freqs has {factors.numel()} factors, expected {self.inv_freq.numel()}"
            )
        self.freq_factors = factors.detach().float().cpu().reshape(-1)
        self.reset_parameters()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``positions``: ``[num_tokens]`` int64 -> ``(cos, signed_sin)``, each
        ``[num_tokens, 1, head_dim]`` in ``dtype``, as ``fused.rotary_`` takes them.

        ``signed_sin`` is ``sin`` with its first half negated, which folds rotate-half's sign
        into the table once per step instead of once per layer.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.attention_scaling).repeat(1, 2)
        sin = freqs.sin() * self.attention_scaling
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]


def _switch_length(config, params: dict, max_model_len: int | None) -> int | None:
    """The sequence length handed to a length-dependent initialiser: ``max_model_len`` when it
    is past the original context (long / rescaled factors), else ``None`` (original ones)."""
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    original = original or config.max_position_embeddings
    if max_model_len is not None and max_model_len > original:
        return int(max_model_len)
    return None
