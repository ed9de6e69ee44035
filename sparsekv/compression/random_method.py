"""Random baseline (as in kvpress's RandomPress), the floor any method should beat.

Score = uniform random numbers from ``LayerView.generator``; a seeded generator makes the kept
set reproducible. Only the forced window is protected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView


@dataclass
class RandomCompressor(Compressor):
    """Uniform random scores (the global RNG when the view has no generator)."""

    stackable = False  # one layer's draws must not depend on which layers compact with it

    name = "random"
    evicts_randomly = True

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32 in ``[0, 1)``."""
        generator = view.generator
        device = view.keys.device if generator is None else generator.device
        scores = torch.rand(view.num_kv_heads, view.num_tokens, generator=generator, device=device)
        return scores.to(view.keys.device)
