"""KNorm (Devoto et al., arXiv 2406.11430): keys with a low L2 norm draw more attention.

Score = minus the L2 norm of each cached key (post-RoPE, fp32); needs no queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView


@dataclass
class KNormCompressor(Compressor):
    """Keeps the smallest-norm keys (plus the forced window)."""

    name = "knorm"

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32 ``-||k_j||_2``."""
        return -torch.linalg.vector_norm(view.keys.float(), dim=-1)
