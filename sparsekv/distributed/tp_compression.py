"""Compression on a tensor-parallel rank: keep per KV head, on the rank that holds the head.

A rank holding whole GQA groups scores its KV heads exactly as one process would: the request's
own compressor runs unchanged on the rank's heads, with no communication. Two cases need this
adapter:

- a randomly evicting method (``Compressor.evicts_randomly``: ``random``) draws the scores of
  every KV head of the model from the request's generator (the same stream on every rank) and
  keeps the rows of the rank's heads, so each head's kept slots are those of one process;
- a replicated KV head (fewer KV heads than ranks) has its query heads split over the ranks
  that share it: before scoring, those ranks all-gather the observation window's queries (and
  their log-sum-exps) of the group and sum the accumulated attention mass, which is reducing the
  group's scores across them; every replica then keeps the same slots, those of one process.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from sparsekv.compression.base import Compressor, LayerView
from sparsekv.distributed.tp_layout import RankShard


class ShardedCompressor:
    """A request's compressor as one tensor-parallel rank runs it (``Compressor.select``).

    Args:
        inner: the request's compressor.
        shard: this rank's slice of the model.
        replica_group: the process group of the ranks sharing this rank's KV head
            (replicated heads only), else ``None``.
    """

    def __init__(self, inner: Compressor, shard: RankShard, replica_group=None) -> None:
        self.inner = inner
        self.shard = shard
        self.replica_group = replica_group
        self.name = inner.name
        self.stackable = inner.stackable
        self.needs_attention_mass = inner.needs_attention_mass
        self.evicts_randomly = inner.evicts_randomly
        self.layer_scores = inner.layer_scores
        self.reconstructs = False  # reconstructing compressors are refused under TP
        # Scoring straight from the pages (``runner.compaction``) sees only this rank's queries.
        self.window_scored = inner.window_scored and not shard.replicated

    def select(
        self, view: LayerView, budget: int, window: int, scores: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``Compressor.select`` for this rank's KV heads: ``[view KV heads, k]`` int64;
        ``scores`` from ``ranking_scores`` of another layer, or ``None``."""
        num_kv_heads, n = view.num_kv_heads, view.num_tokens
        if n <= budget:
            return torch.arange(n, device=view.keys.device).expand(num_kv_heads, n).clone()
        if scores is None:
            scores = self.ranking_scores(view)
        assert scores.shape == (num_kv_heads, n), (scores.shape, num_kv_heads, n)
        return self.inner.keep_top(scores, budget, window, view.backend)

    def keep_top(self, scores: torch.Tensor, budget: int, window: int, backend=None):
        """``Compressor.keep_top`` of the inner compressor (the page-path compaction ranks
        this rank's scores with it)."""
        return self.inner.keep_top(scores, budget, window, backend)

    def ranking_scores(self, view: LayerView) -> torch.Tensor:
        """``[view KV heads, n]`` fp32 scores of this rank's heads: every KV head's draws for
        a random method, the whole group's queries for a replicated head."""
        if self.inner.evicts_randomly:
            return self._random_scores(view)
        if self.shard.replicated:
            view = self._group_view(view)
        return self.inner.ranking_scores(view)

    def score_window(self, summed: torch.Tensor, num_kv_heads: int, num_window: int):
        """The inner compressor's page-path scores (unreplicated heads only)."""
        return self.inner.score_window(summed, num_kv_heads, num_window)

    def _random_scores(self, view: LayerView) -> torch.Tensor:
        """Every KV head's draws (the model's, layer by layer when stacked), this rank's rows."""
        generator = view.generator
        device = view.keys.device if generator is None else generator.device
        total, local = self.shard.num_kv_heads, self.shard.kv_count
        layers = view.num_kv_heads // local
        drawn = torch.rand(layers * total, view.num_tokens, generator=generator, device=device)
        rows = drawn.view(layers, total, -1)[:, self.shard.kv_start : self.shard.kv_start + local]
        return rows.reshape(layers * local, -1).to(view.keys.device)

    def _group_view(self, view: LayerView) -> LayerView:
        """The view with the whole group's window queries (and LSEs, and attention mass)."""
        heads = self.shard.num_heads // self.shard.num_kv_heads  # the group's query heads
        queries = _gather_group(view.window_queries, view.num_kv_heads, self.replica_group)
        lse = view.window_lse
        if lse is not None:
            lse = _gather_group(lse, view.num_kv_heads, self.replica_group)
        accumulated = view.accumulated
        if accumulated is not None:
            accumulated = accumulated.clone()
            dist.all_reduce(accumulated, group=self.replica_group)
        assert queries.shape[0] == view.num_kv_heads * heads, (queries.shape, heads)
        return dataclasses.replace(
            view, window_queries=queries, window_lse=lse, accumulated=accumulated
        )


def _gather_group(local: torch.Tensor, num_kv_heads: int, group) -> torch.Tensor:
    """``[kv * h, ...]`` of this rank -> ``[kv * h * replicas, ...]``, each KV head's query
    heads in model order (the replicas hold consecutive slices of every group)."""
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    rest = local.shape[1:]
    stacked = torch.stack([p.view(num_kv_heads, -1, *rest) for p in parts], dim=1)
    return stacked.reshape(-1, *rest)
