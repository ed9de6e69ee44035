"""TOVA (Oren et al., arXiv 2401.06104): evict the tokens the last query attends to least.

Score = the causal softmax weights of the *last* window query (the newest token) on each slot,
aggregated over each KV group's query heads (``gqa_agg``, mean by default = the paper's head
average). No pooling. Choice: the base still force-keeps the observation window, so every
method honours the contract that a budget includes the window; with
``window = 1`` only the newest token is protected, as in the paper's decode loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView
from sparsekv.compression.scoring import aggregate_gqa, window_attention_scores


@dataclass
class TOVACompressor(Compressor):
    """Last-query attention scores."""

    name = "tova"

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32 attention of the last query row."""
        last_lse = None if view.window_lse is None else view.window_lse[:, -1:]
        per_head = window_attention_scores(
            view.keys,
            view.window_queries[:, -1:],
            last_lse,
            view.scale,
            view.logit_softcap,
            view.backend,
        )
        return aggregate_gqa(per_head, view.num_kv_heads, self.gqa_agg)
