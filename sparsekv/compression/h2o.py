"""H2O (Zhang et al., arXiv 2306.14048): keep the heavy hitters plus the most recent tokens.

Score = accumulated attention mass per slot over every query so far (``LayerView.accumulated``:
prefill column sums of the causal attention matrix, see ``prefill_attention_mass``, plus each
decode step's attention). Half the budget goes to the most recent slots (the paper's split), at
least the observation window; the other half to the largest accumulated mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView


@dataclass
class H2OCompressor(Compressor):
    """Heavy-hitter oracle: accumulated attention, ``max(budget // 2, window)`` recent slots."""

    name = "h2o"
    needs_attention_mass = True

    def score(self, view: LayerView) -> torch.Tensor:
        """``view.accumulated`` as fp32 ``[num_kv_heads, n]``.

        Raises:
            ValueError: the engine gave no accumulated attention for this layer.
        """
        if view.accumulated is None:
            raise ValueError("h2o: LayerView.accumulated is required (accumulated attention)")
        return view.accumulated.float()

    def num_recent(self, budget: int, window: int) -> int:
        return max(budget // 2, window)
