"""The one decoder every supported family runs (``DecoderForCausalLM``).

Hugging Face's ``LlamaForCausalLM`` / ``Qwen2`` / ``Qwen3`` / ``Mistral`` / ``Phi3`` /
``Gemma2`` / ``Gemma3ForCausalLM`` define the math; they are one pre-norm decoder whose
differences are data (``DecoderVariant``, read by ``sparsekv.models.families``):

- attention: fused QKV projection (optional biases), optional per-head q/k RMSNorm before RoPE
  (keys are cached after k-norm and RoPE), RoPE on the leading ``rotary_dim`` dimensions of each
  head, GQA, softmax scale ``head_dim ** -0.5`` or ``query_pre_attn_scalar ** -0.5``, optional
  attention logit soft-cap, a sliding window on the layers ``layer_types`` marks;
- blocks: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, or Gemma's sandwich norms
  ``x + post_norm(f(pre_norm(x)))``; SwiGLU or GeGLU (gate and up fused in one matmul);
- Gemma: ``1 + w`` RMSNorms, embeddings scaled by ``sqrt(hidden_size)`` rounded to the model
  dtype, RoPE base per layer type (Gemma 3), tied embeddings, final logit soft-cap.

Window semantics match transformers' sliding mask (``kv_idx > q_idx - sliding_window``): a
sliding layer's query sees itself and the ``sliding_window - 1`` tokens before it. Sliding layers
are paged as ``LayerSpec("sliding", window)``, so the KV manager frees their pages outside the
window and they are never compressed; full layers are ``full`` (compressible).

Attention and everything about the paged, possibly compressed KV cache is the job of the
per-step attention context passed to ``forward``. Layers pass the residual stream and their last
output separately, so each residual add runs fused with the norm that follows it
(``RMSNorm.add_and_norm``), as vLLM's decoder layers do; the sums and their rounding are those
of the plain ``hidden = hidden + f(norm(hidden))`` form. Runs unchanged on CPU and CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.models.families import variant_of
from sparsekv.models.fused import ops as fused
from sparsekv.models.head_rows import leading_rows
from sparsekv.models.layers import GatedMLP, RMSNorm
from sparsekv.models.rotary import RotaryEmbedding
from sparsekv.models.variant import FULL, SLIDING, DecoderVariant
from sparsekv.models.weights import load_weights


class Attention(nn.Module):
    """Self-attention with fused QKV; K/V handling is the attention context's job."""

    def __init__(self, variant: DecoderVariant, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = variant.num_heads, variant.num_kv_heads
        self.head_dim = head_dim = variant.head_dim
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.qkv_proj = nn.Linear(variant.hidden_size, qkv_size, bias=variant.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, variant.hidden_size, bias=variant.o_bias)
        self.qk_norm = variant.qk_norm
        if self.qk_norm:
            eps, offset = variant.rms_norm_eps, variant.norm_offset
            self.q_norm = RMSNorm(head_dim, eps, unit_offset=offset)
            self.k_norm = RMSNorm(head_dim, eps, unit_offset=offset)
        self.scale = variant.attn_scale
        self.sliding_window = variant.window_of(layer_idx)
        self.rotary_dim = variant.rotary_dim
        self.partial_rotary = variant.rotary_dim < head_dim
        self.q_size = self.num_heads * head_dim
        self.head_counts = (self.num_heads, self.num_kv_heads, self.num_kv_heads)  # q, k, v

    def forward(self, hidden: torch.Tensor, cos_sin: tuple, ctx) -> torch.Tensor:
        """``hidden``: ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        num_tokens = hidden.shape[0]
        heads = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, H + 2 * KVH, d]
        if self.qk_norm:
            q, k, v = heads.split_with_sizes(self.head_counts, dim=1)
            # The norms read the strided views and return new contiguous tensors.
            q, k = self.q_norm(q), self.k_norm(k)
            self._rotate(q, cos_sin)
            self._rotate(k, cos_sin)
        else:
            # Queries and keys are adjacent in the fused projection: one pass, in place.
            self._rotate(heads[:, : self.num_heads + self.num_kv_heads], cos_sin)
            q, k, v = heads.split_with_sizes(self.head_counts, dim=1)
        if self.sliding_window is None:
            out = ctx.attend(self.layer_idx, q, k, v, self.scale)  # [T, H, d]
        else:
            # Passed even when the cache pages this layer as full (benchmark baseline): the
            # mask is the model's math, the page spec only the cache's.
            out = ctx.attend(
                self.layer_idx, q, k, v, self.scale, sliding_window=self.sliding_window
            )
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _rotate(self, x: torch.Tensor, cos_sin: tuple) -> None:
        """RoPE on ``x`` ``[T, heads, d]`` in place, on its first ``rotary_dim`` dimensions."""
        fused.rotary_(x[..., : self.rotary_dim] if self.partial_rotary else x, *cos_sin)


class DecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP; with sandwich norms each is followed by its own norm."""

    def __init__(self, variant: DecoderVariant, layer_idx: int, rope_key: str) -> None:
        super().__init__()
        self.layer_type = variant.layer_types[layer_idx]
        self.rope_key = rope_key
        self.self_attn = Attention(variant, layer_idx)
        size, eps, offset = variant.hidden_size, variant.rms_norm_eps, variant.norm_offset
        self.mlp = GatedMLP(
            size, variant.intermediate_size, variant.activation, bias=variant.mlp_bias
        )
        self.input_layernorm = RMSNorm(size, eps, unit_offset=offset)
        # Without sandwich norms this is the pre-MLP norm (HF's name for it).
        self.post_attention_layernorm = RMSNorm(size, eps, unit_offset=offset)
        self.sandwich = variant.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, unit_offset=offset)
            self.post_feedforward_layernorm = RMSNorm(size, eps, unit_offset=offset)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: tuple, ctx
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the residual stream.

        Args:
            hidden: ``[num_tokens, hidden_size]``, the previous layer's (normed) MLP output,
                not yet added to ``residual``; the (scaled) embeddings when ``residual`` is
                ``None``.
            residual: ``[num_tokens, hidden_size]`` residual stream, or ``None`` (first layer).

        Returns:
            ``(mlp_out, residual)``: this layer's output and the stream it is to be added to
            (by the next layer, or the final norm).
        """
        residual, x = self.input_layernorm.add_and_norm(residual, hidden)
        attn = self.self_attn(x, cos_sin, ctx)
        if not self.sandwich:
            residual, x = self.post_attention_layernorm.add_and_norm(residual, attn)
            return self.mlp(x), residual
        attn = self.post_attention_layernorm(attn)
        residual, x = self.pre_feedforward_layernorm.add_and_norm(residual, attn)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


def text_config(config):
    """The text part of a config (multimodal configs such as ``Gemma3Config`` nest it)."""
    return getattr(config, "text_config", None) or config


class DecoderForCausalLM(nn.Module):
    """A supported family's causal LM over a flattened ragged batch (``interface.CausalLM``).

    Args:
        config: a transformers config of a supported family (``families.FAMILIES``); a
            multimodal config's text part is used. An extra attribute
            ``sliding_aware_paging = False`` makes ``layer_specs()`` page every layer as
            ``full`` while sliding layers still mask with their window: a benchmark baseline
            with the same outputs (run it without compression: its sliding layers would look
            compressible).
        max_model_len: longest sequence the engine serves (sliding windows at least this long
            are no windows; length-dependent RoPE factors, see ``sparsekv.models.rotary``).

    Raises:
        ValueError: unsupported model type, or a bidirectional (non-causal) Gemma 3 config.
    """

    def __init__(self, config, max_model_len: int | None = None) -> None:
        super().__init__()
        config = text_config(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("model: Gemma 3 with use_bidirectional_attention is not supported")
        self.config = config
        self.variant = variant = variant_of(config, max_model_len)
        self.layer_types = list(variant.layer_types)
        self.sliding_aware_paging = bool(getattr(config, "sliding_aware_paging", True))
        self.num_heads, self.num_kv_heads = variant.num_heads, variant.num_kv_heads
        self.head_dim = variant.head_dim
        self.attn_logit_softcap = variant.attn_logit_softcap
        self.final_logit_softcap = variant.final_logit_softcap
        self.embed_tokens = nn.Embedding(variant.vocab_size, variant.hidden_size)
        keys = sorted(set(self.layer_types)) if variant.rope_per_layer_type else [FULL]
        self.rotary = nn.ModuleDict(
            {
                key: RotaryEmbedding(
                    config,
                    variant.rotary_dim,
                    key if variant.rope_per_layer_type else None,
                    max_model_len,
                )
                for key in keys
            }
        )
        self.layers = nn.ModuleList(
            DecoderLayer(variant, i, kind if variant.rope_per_layer_type else FULL)
            for i, kind in enumerate(self.layer_types)
        )
        self.norm = RMSNorm(
            variant.hidden_size, variant.rms_norm_eps, unit_offset=variant.norm_offset
        )
        self.lm_head = nn.Linear(variant.hidden_size, variant.vocab_size, bias=False)
        if variant.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        fused.prepare_fused_ops()  # compile now, at engine start, not on the first request

    def layer_specs(self) -> list[LayerSpec]:
        """``sliding`` (the variant's window) for sliding layers, ``full`` for the others.

        With ``sliding_aware_paging`` off every layer is ``full`` (benchmark baseline).
        """
        window = self.variant.sliding_window
        return [
            LayerSpec("sliding", window)
            if kind == SLIDING and window is not None and self.sliding_aware_paging
            else LayerSpec("full")
            for kind in self.layer_types
        ]

    def rope_frequencies(self) -> list[torch.Tensor]:
        """Per layer, its RoPE frequencies ``[rotary_dim // 2]`` fp32 (radians per position,
        rotate-half layout over a head's leading ``rotary_dim`` dimensions): what compressors
        that move queries along positions read (``LayerView.rope_inv_freq``)."""
        return [self.rotary[layer.rope_key].inv_freq.float() for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        hidden = self.embed_tokens(input_ids)
        if self.variant.embedding_scale:
            # HF rounds the scale to the model dtype first (sqrt(640) becomes 25.25 in bf16).
            # A fill on the device (no host tensor to copy: capturable in a CUDA graph).
            hidden = hidden * hidden.new_full((), self.variant.hidden_size**0.5)
        tables = {key: rope.cos_sin(positions, hidden.dtype) for key, rope in self.rotary.items()}
        residual = None
        rows_after = getattr(ctx, "rows_after", None)
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, tables[layer.rope_key], ctx)
            kept = rows_after(index) if rows_after is not None else None
            if kept is not None:  # rows no later layer reads leave the batch
                kept = kept.to(hidden.device)
                hidden, residual = hidden[kept], residual[kept]
                tables = {key: tuple(t[kept] for t in table) for key, table in tables.items()}
        return self.norm.add_and_norm(residual, hidden)[1]

    def compute_logits(self, hidden: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """``hidden``: ``[num_rows, hidden]`` -> fp32 logits ``[num_rows, vocab_size]``, or over
        token ids ``0 .. num_tokens - 1`` only (``head_rows.leading_rows``: a draft's reduced
        vocabulary, reading that part of the head; the whole vocabulary from ``vocab_size``
        on).

        Soft-capped as ``cap * tanh(logits / cap)`` with a final soft-cap (in the model dtype,
        then fp32, as HF does).

        Raises:
            ValueError: ``num_tokens`` below 1 (or cutting a packed head's group of 16 rows).
        """
        if num_tokens is None or num_tokens >= self.variant.vocab_size:
            logits = self.lm_head(hidden)
        else:
            logits = leading_rows(self.lm_head, hidden, num_tokens)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names (``sparsekv.models.weights``).

        Raises:
            ValueError: a tensor is missing or has the wrong shape (naming both).
        """
        load_weights(self, state_dict)
