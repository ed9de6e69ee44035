"""The model interface: what the runner and the KV manager may rely on.

Every model ``build_model`` returns satisfies :class:`CausalLM`. The engine reads the shapes
(``num_heads``, ``num_kv_heads``, ``head_dim``) to size the page pool, ``layer_specs()`` to page
each layer, ``attn_logit_softcap`` to soft-cap attention logits (and every compression score
computed from them), and runs ``forward`` then ``compute_logits`` once per step.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from sparsekv.kv_cache.spec import LayerSpec


@runtime_checkable
class CausalLM(Protocol):
    """A causal decoder over a flattened ragged batch.

    Attributes:
        num_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (same for every layer).
        head_dim: width of one head (keys, values and queries).
        attn_logit_softcap: ``cap`` of ``cap * tanh(logits / cap)`` applied to the scaled
            attention logits before the softmax (Gemma 2), or ``None``.
        final_logit_softcap: the same on the output logits, or ``None``.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_logit_softcap: float | None
    final_logit_softcap: float | None

    def layer_specs(self) -> list[LayerSpec]:
        """One cache spec per layer: ``full`` (compressible) or ``sliding`` (window)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Hidden states of a step.

        Args:
            input_ids: ``[num_tokens]`` int64, the step's tokens of every request, flattened.
            positions: ``[num_tokens]`` int64 absolute positions in their requests.
            ctx: the attention context (``runner.paged_attention.PagedAttention`` or a test
                reference) with ``attend(layer, q, k, v, scale, sliding_window=None)``. A
                context may also have ``rows_after(layer)``: after each layer the model calls
                it and, when it returns row indices, keeps only those rows (every per-row
                tensor) for the later layers; the returned hidden states are those rows'.

        Returns:
            ``[num_kept_rows, hidden_size]`` final-normed hidden states in the model dtype
            (``num_tokens`` rows unless ``ctx.rows_after`` dropped some).
        """
        ...

    def compute_logits(self, hidden: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> fp32 ``[num_rows, vocab_size]``; with ``num_tokens``,
        the logits of token ids ``0 .. num_tokens - 1`` only ``[num_rows, num_tokens]`` (a
        draft's reduced vocabulary)."""
        ...
