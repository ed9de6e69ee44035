"""SnapKV (Li et al., arXiv 2404.14469): keep the prefix tokens the observation window attends to.

Score of prefix slot ``j`` at query head ``h``: the mean over the ``w`` window queries of their
causal softmax weight on ``j`` (the paper sums; the mean is the same ranking and mirrors
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
    window_scored = True

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32; the last ``w`` (window) slots score ``+inf``."""
        summed = window_attention_scores(
            view.keys,
            view.window_queries,
            view.window_lse,
            view.scale,
            view.logit_softcap,
            view.backend,
        )
        return self.score_window(summed, view.num_kv_heads, view.num_window)

    def score_window(self, summed: torch.Tensor, num_kv_heads: int, num_window: int):
        """``score`` from the summed window attention.

        Args:
            summed: ``[num_heads, n]`` fp32 ``scoring.window_attention_scores`` of the view.
            num_kv_heads: KV heads of the view.
            num_window: window rows ``w`` the sums ran over.

        Returns:
            ``[num_kv_heads, n]`` fp32; the last ``w`` (window) slots score ``+inf``.
        """
        num_prefix = summed.shape[1] - num_window
        # Only the prefix columns are ranked.
        per_head = pool_scores(summed[:, :num_prefix] / num_window, self.pooling, self.kernel_size)
        prefix = aggregate_gqa(per_head, num_kv_heads, self.gqa_agg)
        window = prefix.new_full((num_kv_heads, num_window), float("inf"))
        return torch.cat([prefix, window], dim=1)
