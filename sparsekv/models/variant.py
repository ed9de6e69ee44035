"""The shape and math choices of one decoder, as data (``DecoderVariant``).

Every supported family is the same pre-norm decoder (``sparsekv.models.decoder``) with a few
switches: biases, per-head q/k RMSNorm, Gemma's ``1 + w`` norms and sandwich norms, GeGLU,
embedding scale, attention scale, soft-caps, partial rotary, and which layers attend through a
sliding window. ``variant_of`` reads them from a transformers config; the per-family defaults
(what a family's config leaves implicit) live in ``sparsekv.models.families``.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class DecoderVariant:
    """One decoder's switches.

    Attributes:
        family: the family name (``llama``, ``qwen2``, ... see ``families.FAMILIES``).
        hidden_size, intermediate_size, vocab_size: widths.
        num_heads, num_kv_heads, head_dim: attention shape (``head_dim`` may differ from
            ``hidden_size // num_heads``: Qwen3, Gemma).
        rms_norm_eps: RMSNorm epsilon.
        qkv_bias: biases on the q/k/v projections (Qwen2); ``o_bias`` on the output one.
        mlp_bias: biases on the MLP projections.
        qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3).
        norm_offset: every RMSNorm scales by ``1 + w`` (Gemma) instead of ``w``.
        sandwich_norms: post-attention and pre/post-feed-forward norms (Gemma 2/3) instead of
            one norm between attention and MLP.
        activation: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU).
        embedding_scale: multiply embeddings by ``sqrt(hidden_size)`` (rounded to the model
            dtype first, as HF does).
        attn_scale: softmax scale (``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5``).
        attn_logit_softcap, final_logit_softcap: ``cap * tanh(x / cap)`` caps, or ``None``.
        layer_types: per layer ``sliding_attention`` or ``full_attention``.
        sliding_window: window of the sliding layers in tokens (a query sees itself and the
            ``sliding_window - 1`` tokens before it), ``None`` when no layer slides.
        rotary_dim: leading dimensions of each head that RoPE rotates (partial rotary: Phi).
        rope_per_layer_type: ``config.rope_parameters`` holds one entry per layer type.
        tie_word_embeddings: the output head is the embedding matrix.
    """

    family: str
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embedding_scale: bool = False
    attn_scale: float = 1.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rotary_dim: int = 0
    rope_per_layer_type: bool = False
    tie_word_embeddings: bool = False

    def window_of(self, layer: int) -> int | None:
        """The attention window of ``layer``, ``None`` for a full layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


def head_dim_of(config) -> int:
    """``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types_of(config, max_model_len: int | None = None) -> tuple[tuple[str, ...], int | None]:
    """Per-layer types and the sliding window, from a config.

    ``config.layer_types`` when present (Gemma 2/3, Qwen2/3 in transformers 5); else every layer
    slides when ``config.sliding_window`` is set (Mistral, Phi-3), and a Gemma 3 config without
    either falls back to its ``sliding_window_pattern``. A window of at least ``max_model_len``
    never masks anything: those layers are full (so they stay compressible and prefix-cacheable).

    Returns:
        ``(layer_types, sliding_window)``; the window is ``None`` when no layer slides.
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        types = tuple(types)
    elif getattr(config, "sliding_window_pattern", None) or getattr(
        config, "_sliding_window_pattern", None
    ):
        pattern = getattr(config, "sliding_window_pattern", None) or config._sliding_window_pattern
        types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))
    else:
        types = tuple(SLIDING if window else FULL for _ in range(num_layers))
    if not window or (max_model_len is not None and window >= max_model_len):
        return tuple(FULL for _ in types), None
    if SLIDING not in types:
        return types, None
    return types, int(window)


def softcap_of(config, name: str) -> float | None:
    """A soft-cap attribute of the config as a float, ``None`` when unset or zero."""
    value = getattr(config, name, None)
    return float(value) if value else None
