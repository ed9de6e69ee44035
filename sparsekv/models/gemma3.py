"""Gemma 3 text decoder (Gemma Team 2025, "Gemma 3 Technical Report", arXiv 2503.19786).

Hugging Face's ``Gemma3ForCausalLM`` defines the math; this file follows it with fused QKV and
gate/up projections and the paged attention context passed in as an argument:

- interleaved local (sliding-window) and global layers, from ``config.layer_types``
  (5 local : 1 global in the released models), each type with its own RoPE base;
- q/k RMSNorm before RoPE (so keys are cached after k-norm and RoPE), Gemma's ``(1 + w)`` norm;
- embeddings scaled by ``sqrt(hidden_size)`` rounded to the model dtype, as HF does;
- attention scale ``query_pre_attn_scalar ** -0.5``;
- sandwich norms: post-attention, pre- and post-feedforward RMSNorm around GeGLU (tanh GELU);
- optional final logit soft-capping, tied embeddings.

Window semantics match transformers' sliding mask (``kv_idx > q_idx - sliding_window``): a local
layer's query sees itself and the ``sliding_window - 1`` tokens before it. Local layers are paged
as ``LayerSpec("sliding", window)``, so the KV manager frees their pages outside the window and
they are never compressed; global layers are ``full`` (compressible).

As in ``llama.py``, layers pass the residual stream and their last (post-feedforward-normed)
output separately, so each residual add runs fused with the next pre-norm; the sums and their
rounding are those of HF's ``hidden = hidden + post_norm(f(pre_norm(hidden)))``.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.models.fused import ops as fused
from sparsekv.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from sparsekv.models.llama import _cat, _get, _load_into

SLIDING, FULL = "sliding_attention", "full_attention"


def text_config(config):
    """The text part of a Gemma 3 config (``Gemma3Config`` nests it; ``Gemma3TextConfig`` is it)."""
    return getattr(config, "text_config", None) or config


def layer_types(config) -> list[str]:
    """Per-layer ``sliding_attention`` / ``full_attention``.

    Uses ``config.layer_types``; configs without it fall back to ``sliding_window_pattern``
    (every ``pattern``-th layer is global, the others local; 6 in Gemma 3).
    """
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None)
    pattern = pattern or getattr(config, "_sliding_window_pattern", None) or 6
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


class Gemma3Attention(nn.Module):
    """Self-attention with fused QKV, q/k RMSNorm and an optional sliding window.

    Args:
        config: a ``Gemma3TextConfig``.
        layer_idx: index of the layer.
        layer_type: ``sliding_attention`` or ``full_attention``.
    """

    def __init__(self, config, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.sliding_window = config.sliding_window if layer_type == SLIDING else None

    def forward(self, hidden: torch.Tensor, cos_sin: tuple, ctx) -> torch.Tensor:
        """``hidden``: ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        # The norms read the strided views and return new contiguous tensors, rotated in place.
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [T, H, d]
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, KVH, d]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        fused.rotary_(q, *cos_sin)
        fused.rotary_(k, *cos_sin)
        # The window is passed even when the cache pages this layer as full (benchmark
        # baseline): the mask is the model's math, the page spec only the cache's.
        out = ctx.attend(self.layer_idx, q, k, v, self.scale, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, q_size))


class Gemma3DecoderLayer(nn.Module):
    """Pre-norm attention and GeGLU MLP, each followed by its own output norm."""

    def __init__(self, config, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(config, layer_idx, layer_type)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "gelu_tanh")
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: tuple, ctx
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sandwich-norm block on the residual stream.

        Args:
            hidden: ``[num_tokens, hidden_size]``, the previous layer's normed MLP output, not
                yet added to ``residual``; the scaled embeddings when ``residual`` is ``None``.
            residual: ``[num_tokens, hidden_size]`` residual stream, or ``None`` (first layer).

        Returns:
            ``(post_feedforward_layernorm(mlp_out), residual)``, to be added by the next layer
            or the final norm.
        """
        residual, x = self.input_layernorm.add_and_norm(residual, hidden)
        attn = self.post_attention_layernorm(self.self_attn(x, cos_sin, ctx))
        residual, x = self.pre_feedforward_layernorm.add_and_norm(residual, attn)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 causal LM (text) over a flattened ragged batch.

    Args:
        config: a transformers ``Gemma3TextConfig`` (or a ``Gemma3Config``; its text part is
            used). An extra attribute ``sliding_aware_paging = False`` on the config makes
            ``layer_specs()`` page every layer as ``full`` while local layers still mask with
            their window: a baseline for benchmarks, with the same outputs. Run that baseline
            without compression: its local layers would look compressible.

    Raises:
        ValueError: the config asks for bidirectional attention (not a causal LM).
    """

    def __init__(self, config) -> None:
        super().__init__()
        config = text_config(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("model: Gemma 3 with use_bidirectional_attention is not supported")
        self.config = config
        self.layer_types = layer_types(config)
        self.sliding_aware_paging = bool(getattr(config, "sliding_aware_paging", True))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, kind) for i, kind in enumerate(self.layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # Gemma 3 always ties them
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(config, head_dim, kind)
                for kind in sorted(set(self.layer_types))
            }
        )
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)
        # Read by the model runner and handed to the attention context (PagedAttention).
        self.attn_logit_softcap = getattr(config, "attn_logit_softcapping", None)
        fused.prepare_fused_ops()  # compile now, at engine start, not on the first request

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    def layer_specs(self) -> list[LayerSpec]:
        """``sliding`` (window from the config) for local layers, ``full`` for global ones.

        With ``sliding_aware_paging`` off every layer is ``full`` (benchmark baseline).
        """
        window = self.config.sliding_window
        return [
            LayerSpec("sliding", window)
            if kind == SLIDING and self.sliding_aware_paging
            else LayerSpec("full")
            for kind in self.layer_types
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        hidden = self.embed_tokens(input_ids)
        # HF rounds the scale to the model dtype first (sqrt(640) becomes 25.25 in bf16).
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        hidden = hidden * scale.to(hidden.device)
        cos_sin = {
            kind: rope.cos_sin(positions, hidden.dtype) for kind, rope in self.rotary.items()
        }
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin[layer.layer_type], ctx)
        return self.norm.add_and_norm(residual, hidden)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``[num_rows, hidden]`` -> fp32 logits ``[num_rows, vocab_size]``.

        Soft-capped as ``cap * tanh(logits / cap)`` when the config sets
        ``final_logit_softcapping`` (in the model dtype, then fp32, as HF does).
        """
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names (``model.layers.{i}...``), fusing QKV and gate/up.

        Accepts the text model's names with or without the multimodal ``language_model.``
        infix; ``lm_head.weight`` is ignored (tied to the embeddings).

        Raises:
            ValueError: a parameter is missing or has the wrong shape.
        """
        state_dict = _strip_language_model(state_dict)
        own = {}
        for i in range(len(self.layers)):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            own[dst + "self_attn.qkv_proj.weight"] = _cat(
                state_dict, [attn + p + "_proj.weight" for p in "qkv"]
            )
            if attn + "q_proj.bias" in state_dict:
                own[dst + "self_attn.qkv_proj.bias"] = _cat(
                    state_dict, [attn + p + "_proj.bias" for p in "qkv"]
                )
                own[dst + "self_attn.o_proj.bias"] = _get(state_dict, attn + "o_proj.bias")
            own[dst + "self_attn.o_proj.weight"] = _get(state_dict, attn + "o_proj.weight")
            for norm in ("q_norm", "k_norm"):
                own[dst + f"self_attn.{norm}.weight"] = _get(state_dict, attn + norm + ".weight")
            mlp = src + "mlp."
            own[dst + "mlp.gate_up_proj.weight"] = _cat(
                state_dict, [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
            )
            own[dst + "mlp.down_proj.weight"] = _get(state_dict, mlp + "down_proj.weight")
            for norm in _LAYER_NORMS:
                own[dst + norm + ".weight"] = _get(state_dict, src + norm + ".weight")
        own["embed_tokens.weight"] = _get(state_dict, "model.embed_tokens.weight")
        own["norm.weight"] = _get(state_dict, "model.norm.weight")
        self.lm_head.weight = self.embed_tokens.weight
        _load_into(self, own)


_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _strip_language_model(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map ``model.language_model.X`` (multimodal checkpoints) to ``model.X``."""
    prefix = "model.language_model."
    if not any(name.startswith(prefix) for name in state_dict):
        return state_dict
    return {
        ("model." + name[len(prefix) :] if name.startswith(prefix) else name): tensor
        for name, tensor in state_dict.items()
    }
