"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM): RMSNorm, RoPE, GQA, SwiGLU.

Hugging Face's ``LlamaForCausalLM`` defines the math; this file keeps it in one readable
module with fused QKV and gate/up projections, and delegates attention (and everything about
the paged, possibly compressed KV cache) to the per-step attention context passed in as an
argument. Runs unchanged on CPU and CUDA.

Layers pass the residual stream and their last output separately, so each residual add runs
fused with the norm that follows it (``RMSNorm.add_and_norm``), as vLLM's decoder layers do;
the sums and their rounding are those of the plain ``hidden = hidden + f(norm(hidden))`` form.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.models.fused import ops as fused
from sparsekv.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV; K/V handling is the attention context's job."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.head_counts = (self.num_heads, self.num_kv_heads, self.num_kv_heads)  # q, k, v

    def forward(self, hidden: torch.Tensor, cos_sin: tuple, ctx) -> torch.Tensor:
        """``hidden``: ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        num_tokens = hidden.shape[0]
        heads = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, H + 2 * KVH, d]
        # Queries and keys are adjacent in the fused projection: rotate them in one pass, in place.
        fused.rotary_(heads[:, : self.num_heads + self.num_kv_heads], *cos_sin)
        q, k, v = heads.split_with_sizes(self.head_counts, dim=1)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale)  # [T, H, d]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            "silu",
            bias=bool(getattr(config, "mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: tuple, ctx
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pre-norm block on the residual stream.

        Args:
            hidden: ``[num_tokens, hidden_size]``, the previous layer's MLP output, not yet
                added to ``residual``; the embeddings when ``residual`` is ``None``.
            residual: ``[num_tokens, hidden_size]`` residual stream, or ``None`` (first layer).

        Returns:
            ``(mlp_out, residual)``: this layer's MLP output and the stream it is to be added to
            (by the next layer, or the final norm).
        """
        residual, x = self.input_layernorm.add_and_norm(residual, hidden)
        attn = self.self_attn(x, cos_sin, ctx)
        residual, x = self.post_attention_layernorm.add_and_norm(residual, attn)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flattened ragged batch.

    Args:
        config: a transformers ``LlamaConfig`` (or Mistral/Qwen2 config).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(config, head_dim)
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
        """Every layer keeps a full (compressible) cache; Mistral's optional window aside."""
        window = getattr(self.config, "sliding_window", None)
        if self.config.model_type == "mistral" and window:
            return [LayerSpec("sliding", window) for _ in self.layers]
        return [LayerSpec("full") for _ in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin, ctx)
        return self.norm.add_and_norm(residual, hidden)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``[num_rows, hidden]`` -> fp32 logits ``[num_rows, vocab_size]``."""
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names, fusing QKV and gate/up.

        Raises:
            ValueError: a parameter is missing or has the wrong shape.
        """
        own = {}
        for i in range(self.config.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            own[dst + "self_attn.qkv_proj.weight"] = _cat(
                state_dict, [attn + p + "_proj.weight" for p in "qkv"]
            )
            if attn + "q_proj.bias" in state_dict:
                own[dst + "self_attn.qkv_proj.bias"] = _cat(
                    state_dict, [attn + p + "_proj.bias" for p in "qkv"]
                )
            own[dst + "self_attn.o_proj.weight"] = _get(state_dict, attn + "o_proj.weight")
            mlp = src + "mlp."
            own[dst + "mlp.gate_up_proj.weight"] = _cat(
                state_dict, [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
            )
            own[dst + "mlp.down_proj.weight"] = _get(state_dict, mlp + "down_proj.weight")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                own[dst + norm + ".weight"] = _get(state_dict, src + norm + ".weight")
        own["embed_tokens.weight"] = _get(state_dict, "model.embed_tokens.weight")
        own["norm.weight"] = _get(state_dict, "model.norm.weight")
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        else:
            own["lm_head.weight"] = _get(state_dict, "lm_head.weight")
        _load_into(self, own)


def _get(state_dict: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"model: checkpoint lacks parameter {name!r}")
    return state_dict[name]


def _cat(state_dict: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([_get(state_dict, n) for n in names], dim=0)


def _load_into(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(module.named_parameters())
    for name, tensor in tensors.items():
        if name not in params:
            continue
        target = params[name]
        if target.shape != tensor.shape:
            raise ValueError(
                f"model: parameter {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
