"""The supported model families: transformers ``model_type`` -> the decoder's switches.

One row per family. Each reads a transformers config into a ``DecoderVariant``; what differs
between families is only what their configs leave implicit (Qwen2's q/k/v biases, Gemma's
``1 + w`` norms and embedding scale, ...). Adding a family is adding a row here (and, for GGUF
files, an entry in ``sparsekv.loader.name_maps.ARCHITECTURES``); see docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sparsekv.models.variant import (
    DecoderVariant,
    head_dim_of,
    layer_types_of,
    softcap_of,
)


@dataclass(frozen=True)
class Family:
    """One supported family.

    Attributes:
        name: display name (``sparsekv models``).
        model_types: transformers ``model_type`` values it serves.
        hf_architecture: transformers class name (``config.architectures`` of converted folders).
        gguf_architecture: llama.cpp's ``general.architecture`` of its GGUF files.
        switches: the family's fixed switches; ``variant_of`` reads the rest from the config.
        examples: checkpoints of the family, for the listing.
    """

    name: str
    model_types: tuple[str, ...]
    hf_architecture: str
    gguf_architecture: str
    switches: Callable[[object], dict]
    examples: str


def _llama(config) -> dict:
    return {
        "qkv_bias": bool(getattr(config, "attention_bias", False)),
        "o_bias": bool(getattr(config, "attention_bias", False)),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
    }


def _qwen2(config) -> dict:
    return {"qkv_bias": True}


def _qwen3(config) -> dict:
    bias = bool(getattr(config, "attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


def _phi3(config) -> dict:
    return {}


def _gemma(config, qk_norm: bool) -> dict:
    return {
        "qkv_bias": bool(getattr(config, "attention_bias", False)),
        "o_bias": bool(getattr(config, "attention_bias", False)),
        "qk_norm": qk_norm,
        "norm_offset": True,
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "embedding_scale": True,
        "attn_scale": float(config.query_pre_attn_scalar) ** -0.5,
        "attn_logit_softcap": softcap_of(config, "attn_logit_softcapping"),
        "final_logit_softcap": softcap_of(config, "final_logit_softcapping"),
        "tie_word_embeddings": True,
    }


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "llama",
            ("llama",),
            "LlamaForCausalLM",
            "llama",
            _llama,
            "Llama 2, Llama 3.x (rope_scaling llama3 / linear / yarn / dynamic), SmolLM2",
        ),
        Family(
            "mistral",
            ("mistral",),
            "MistralForCausalLM",
            "llama",
            _llama,
            "Mistral 7B v0.1-v0.3 (a sliding window shorter than the context slides)",
        ),
        Family(
            "qwen2",
            ("qwen2",),
            "Qwen2ForCausalLM",
            "qwen2",
            _qwen2,
            "Qwen2, Qwen2.5 (q/k/v biases, tied or untied embeddings)",
        ),
        Family(
            "qwen3",
            ("qwen3",),
            "Qwen3ForCausalLM",
            "qwen3",
            _qwen3,
            "Qwen3 dense (per-head q/k RMSNorm, independent head_dim)",
        ),
        Family(
            "phi3",
            ("phi3",),
            "Phi3ForCausalLM",
            "phi3",
            _phi3,
            "Phi-3, Phi-3.5 mini (fused qkv / gate_up, longrope, partial rotary)",
        ),
        Family(
            "gemma2",
            ("gemma2",),
            "Gemma2ForCausalLM",
            "gemma2",
            lambda config: _gemma(config, qk_norm=False),
            "Gemma 2 (alternating sliding/global layers, soft-caps 50 / 30)",
        ),
        Family(
            "gemma3",
            ("gemma3_text", "gemma3"),
            "Gemma3ForCausalLM",
            "gemma3",
            lambda config: _gemma(config, qk_norm=True),
            "Gemma 3 text (5 local : 1 global layers, q/k norm, RoPE base per layer type)",
        ),
    )
}

# transformers model_type -> family.
MODEL_TYPES: dict[str, Family] = {
    model_type: family for family in FAMILIES.values() for model_type in family.model_types
}


def supported_model_types() -> list[str]:
    """Every ``model_type`` ``build_model`` accepts, sorted."""
    return sorted(MODEL_TYPES)


def family_of(config) -> Family:
    """The family serving ``config.model_type``.

    Raises:
        ValueError: the model type is not supported (the message lists the supported ones).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model: architecture {model_type!r} is not supported "
            f"(supported: {', '.join(supported_model_types())})"
        )
    return MODEL_TYPES[model_type]


def variant_of(config, max_model_len: int | None = None) -> DecoderVariant:
    """The decoder switches of a (text) config.

    Args:
        config: a transformers config of a supported family.
        max_model_len: longest sequence the engine serves; a sliding window at least this
            long is no window (``layer_types_of``).

    Raises:
        ValueError: unsupported model type.
    """
    family = family_of(config)
    head_dim = head_dim_of(config)
    types, window = layer_types_of(config, max_model_len)
    rope = getattr(config, "rope_parameters", None) or {}
    partial = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor")
    partial = partial or 1.0
    values = dict(
        family=family.name,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        attn_scale=head_dim**-0.5,
        layer_types=types,
        sliding_window=window,
        rotary_dim=int(head_dim * partial),
        rope_per_layer_type=_rope_per_layer_type(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
    values.update(family.switches(config))
    return DecoderVariant(**values)


def _rope_per_layer_type(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return any(isinstance(value, dict) for value in params.values())
