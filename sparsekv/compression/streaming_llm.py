"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks plus a recent window.

Keeps the first ``sinks`` slots (the "attention sinks", 4 by default) and the most recent
``budget - sinks``. Scores: ``+inf`` for the sinks, the slot index elsewhere (more recent =
higher); with the base's forced window this keeps exactly sinks + recent whenever
``budget >= window + sinks``, and as many sinks as fit otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView


@dataclass
class StreamingLLMCompressor(Compressor):
    """Sinks + most recent slots; ignores queries and attention.

    Attributes:
        sinks: leading slots always kept.
    """

    name = "streaming_llm"

    sinks: int = 4

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32: ``+inf`` on the first ``sinks`` slots, else the index."""
        n = view.num_tokens
        scores = torch.arange(n, dtype=torch.float32, device=view.keys.device)
        scores[: self.sinks] = float("inf")
        return scores.expand(view.num_kv_heads, n).clone()
