"""The compressor interface: a read-only layer view in, scores out; the base turns scores into
kept slots under a budget (docs/design.md, "Compression"; docs/compression.md).

Subclasses implement one hook, ``score``. ``select`` does the shared mechanics once: force-keep
the most recent slots (the observation window), take the top scores among the rest per KV head
with ties going to the more recent slot, and return sorted slot indices.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.attention.selection import kept_indices_prefer_recent, top_indices_prefer_recent
from sparsekv.compression.head_budgets import adaptive_head_kept
from sparsekv.config import CompressionConfig

__all__ = [
    "Compressor",
    "LayerView",
    "ReconstructionRows",
    "kept_indices_prefer_recent",
    "top_indices_prefer_recent",
]


@dataclass(frozen=True)
class ReconstructionRows:
    """One segment of a reconstruction pass over a layer's held slots (KVzip).

    The segment's tokens follow the ``n`` held slots: row ``i`` sits at slot ``n + i`` and
    sees every held slot and the segment's rows ``<= i`` (causal), nothing of other segments.

    Attributes:
        queries: ``[num_heads, m, head_dim]`` post-RoPE queries of the segment's rows.
        keys: ``[num_kv_heads, m, head_dim]`` their keys (held only for the pass, never
            written to the pages), in the cache dtype.
        lse: ``[num_heads, m]`` fp32 log-sum-exp of each row over the slots it sees (held
            slots and the segment's own rows), from the attention; ``None``: compute it.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    lse: torch.Tensor | None


@dataclass(frozen=True)
class LayerView:
    """What a compressor may read of one (request, layer); never modified.

    Attributes:
        keys: ``[num_kv_heads, n, head_dim]`` held slots' keys, post-RoPE (and k-norm), in the
            cache dtype.
        values: ``[num_kv_heads, n, head_dim]`` held slots' values.
        window_queries: ``[num_heads, w, head_dim]`` queries of the last ``w <= n`` tokens (the
            observation window at prefill; the stored recent queries at decode), post-RoPE.
            Query ``i`` is the token of slot ``n - w + i`` and sees slots ``j <= n - w + i``.
        window_lse: ``[num_heads, w]`` fp32 natural-log softmax denominator of those rows over
            exactly the held slots they see, from the attention kernel; ``None`` lets the
            compressor compute it.
        scale: softmax scale of the layer.
        accumulated: ``[num_kv_heads, n]`` fp32 H2O attention mass per slot (prefill column
            sums plus every decode step's attention, summed over each group's query heads), or
            ``None`` where no compressor needs it.
        generator: random source of the ``random`` baseline (seeded per request), or ``None``.
        logit_softcap: the model's attention soft-cap (Gemma 2): scores from attention
            weights use the capped logits the attention softmaxed; ``None``: none.
        backend: the engine's attention backend, which scoring and selection run on
            (``None``: the PyTorch reference, for direct callers such as tests).
        rope_inv_freq: ``[r // 2]`` fp32 RoPE frequencies of the layer (radians per position,
            rotate-half layout over the leading ``r`` dimensions of a head), for methods that
            move queries along positions; ``None``: unknown or no RoPE.
        reconstruction: the segments of a reconstruction pass over the held slots, run in
            the same forward as the prompt (compressors with ``reconstructs`` set, at a
            prefill step that compresses); empty elsewhere.
    """

    keys: torch.Tensor
    values: torch.Tensor
    window_queries: torch.Tensor
    window_lse: torch.Tensor | None
    scale: float
    accumulated: torch.Tensor | None = None
    generator: torch.Generator | None = None
    logit_softcap: float | None = None
    backend: AttentionBackend | None = None
    rope_inv_freq: torch.Tensor | None = None
    reconstruction: tuple[ReconstructionRows, ...] = ()

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        """Held slots ``n``."""
        return self.keys.shape[1]

    @property
    def num_window(self) -> int:
        """Window query rows ``w``."""
        return self.window_queries.shape[1]


@dataclass
class Compressor(abc.ABC):
    """Scores a layer's slots; ``select`` keeps the best ``budget`` of them.

    Attributes:
        window: observation window in tokens (the engine passes it to ``select`` as well).
        pooling: ``max``, ``avg`` or ``none`` score smoothing (methods that pool).
        kernel_size: odd pooling kernel in tokens.
        gqa_agg: ``mean`` or ``max`` over a KV group's query heads (methods that use queries).
        layer_scores: ``own`` or ``first``: the engine ranks every budgeted layer that
            compresses in a forward by the first one's scores (``CompressionConfig``).
    """

    name: ClassVar[str] = ""
    # ``select`` treats KV heads independently (no shared random stream), so the layers of a
    # request can be scored as one view whose heads are the layers' heads stacked.
    stackable: ClassVar[bool] = True
    # ``score`` depends on the view only through the summed window attention
    # (``scoring.window_attention_scores``): such methods also define
    # ``score_window(summed [num_heads, n], num_kv_heads, num_window) -> [num_kv_heads, n]``
    # and can be scored straight from the pages (``runner.compaction``).
    window_scored: ClassVar[bool] = False
    # ``score`` reads ``LayerView.reconstruction``: a prefill step that compresses appends the
    # rows of ``reconstruction_segments`` to the request's batch (``runner.model_runner``).
    reconstructs: ClassVar[bool] = False
    # ``score`` reads ``LayerView.accumulated``: the attention keeps every query's attention
    # mass per slot for the request (prefill column sums plus each decode step), a prefix hit
    # cannot supply it (the request recomputes its whole prompt), and the static decode path
    # (which keeps no accumulator) does not take the request.
    needs_attention_mass: ClassVar[bool] = False
    # ``score`` draws from the request's random stream (``LayerView.generator``): the kept set
    # depends on the request's seed, so a compressed context is never shared between requests,
    # and a tensor-parallel rank draws every KV head's scores to keep the stream in step.
    evicts_randomly: ClassVar[bool] = False

    window: int = 32
    pooling: str = "max"
    kernel_size: int = 15
    gqa_agg: str = "mean"
    layer_scores: str = "own"

    @classmethod
    def from_config(cls, config: CompressionConfig) -> Compressor:
        """Build from a validated policy; method-specific settings keep their defaults."""
        return cls(
            window=config.window,
            pooling=config.pooling,
            kernel_size=config.kernel_size,
            gqa_agg=config.gqa_agg,
            layer_scores=config.layer_scores,
        )

    @staticmethod
    def layer_schedule(
        budget: int, window: int, num_prompt_tokens: int, num_layers: int
    ) -> list[int]:
        """Budgets of the ``num_layers`` budgeted layers, bottom first, for an average
        ``budget`` (slots, window included): uniform by default; a method with its own
        schedule (PyramidKV) overrides this.

        Returns:
            ``num_layers`` budgets in slots, each ``>= window + 1``.
        """
        return [budget] * num_layers

    def bind(self, tokenizer) -> None:
        """Read what the method needs from the engine's tokenizer (called once per request
        before its first step; most methods need nothing)."""
        return None

    @abc.abstractmethod
    def score(self, view: LayerView) -> torch.Tensor:
        """Importance of every held slot, higher = keep.

        Returns:
            ``[num_kv_heads, n]`` fp32. Slots that must stay may score ``+inf``.
        """

    def num_recent(self, budget: int, window: int) -> int:
        """Most recent slots kept regardless of score (the observation window by default)."""
        return window

    def select(
        self, view: LayerView, budget: int, window: int, scores: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Slots to keep per KV head (the budget includes the window; ties go to the newer slot).

        The last ``num_recent(budget, window)`` slots are always kept; the other
        ``budget - recent`` are the highest scores among the older slots, ties going to the
        more recent slot (higher index). If ``n <= budget`` every slot is kept.

        Args:
            view: the layer.
            budget: slots to keep, window included (``>= window + 1`` for valid policies).
            window: observation window in tokens.
            scores: ``[num_kv_heads, n]`` scores to rank by instead of ``score(view)`` (another
                layer's, ``layer_scores = "first"``).

        Returns:
            ``[num_kv_heads, k]`` int64 slot indices, ascending per row, ``k = min(budget, n)``.
        """
        num_kv_heads, n = view.num_kv_heads, view.num_tokens
        if n <= budget:
            return torch.arange(n, device=view.keys.device).expand(num_kv_heads, n).clone()
        scores = self._scores(view, scores)
        return self.keep_top(scores, budget, window, view.backend)

    def select_heads(
        self, view: LayerView, budget: int, window: int, scores: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Head-wise ``select`` (``--kv-head-budgets adaptive``): the layer's KV heads share
        ``num_kv_heads * budget`` slots by score (``head_budgets.adaptive_head_kept``, Ada-KV),
        each keeping its ``num_recent`` newest slots. ``scores`` as in ``select``.

        Returns:
            One int64 tensor of ascending slot indices per KV head (lengths differ; they sum
            to ``num_kv_heads * min(budget, n)``).
        """
        num_kv_heads, n = view.num_kv_heads, view.num_tokens
        if n <= budget:
            return [torch.arange(n, device=view.keys.device) for _ in range(num_kv_heads)]
        scores = self._scores(view, scores)
        num_recent = min(self.num_recent(budget, window), budget)
        return adaptive_head_kept(scores, budget, num_recent)

    def ranking_scores(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32 scores that ``select`` ranks the view's slots by."""
        scores = self.score(view).float()
        expected = (view.num_kv_heads, view.num_tokens)
        assert scores.shape == expected, (scores.shape, expected)
        return scores

    def _scores(self, view: LayerView, scores: torch.Tensor | None) -> torch.Tensor:
        """The given scores (another layer's ``ranking_scores``), else this view's."""
        if scores is None:
            return self.ranking_scores(view)
        assert scores.shape == (view.num_kv_heads, view.num_tokens), scores.shape
        return scores

    def keep_top(
        self,
        scores: torch.Tensor,
        budget: int,
        window: int,
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """``select``'s rule on given scores ``[num_kv_heads, n]`` with ``n > budget``:
        ``[num_kv_heads, budget]`` int64 kept slots, ascending per row, ranked by
        ``backend.kept_indices`` (``None``: the PyTorch rule of ``attention.selection``)."""
        num_kv_heads, n = scores.shape
        num_recent = min(self.num_recent(budget, window), budget)
        num_older = n - num_recent
        older = scores[:, :num_older]
        if backend is None:
            chosen = kept_indices_prefer_recent(older, budget - num_recent)
        else:
            chosen = backend.kept_indices(older, budget - num_recent)
        recent = torch.arange(num_older, n, device=scores.device).expand(num_kv_heads, num_recent)
        # Both parts ascend and every chosen slot precedes the recent ones: no sort needed.
        return torch.cat([chosen, recent], dim=1)
