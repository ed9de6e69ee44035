"""SnapKV (Li et al., arXiv 2404.14469): keep the prefix tokens the observation window attends to.

Score of prefix slot ``j`` at query head ``h``: the mean over the ``w`` window queries of their
causal softmax weight on ``j`` (REFERENCE.md §1 sums; the mean is the same ranking and mirrors
kvpress exactly), smoothed by 1-D pooling over the prefix only, then aggregated over each KV
group's query heads. The window slots score ``+inf``; the base keeps them anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView
from sparsekv.compression.scoring import aggregate_gqa, pool_scores, window_attention_scores


@dataclass
class SnapKVCompressor(Compressor):
    """SnapKV scores (kvpress order: window mean -> pooling per query head -> group mean/max)."""

    name = "snapkv"

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32; the last ``w`` (window) slots score ``+inf``."""
        n, w = view.num_tokens, view.num_window
        num_prefix = n - w
        # [num_heads, n] summed weights; only the prefix columns are ranked.
        summed = window_attention_scores(
            view.keys, view.window_queries, view.window_lse, view.scale
        )
        per_head = pool_scores(summed[:, :num_prefix] / w, self.pooling, self.kernel_size)
        prefix = aggregate_gqa(per_head, view.num_kv_heads, self.gqa_agg)
        window = prefix.new_full((view.num_kv_heads, w), float("inf"))
        return torch.cat([prefix, window], dim=1)
