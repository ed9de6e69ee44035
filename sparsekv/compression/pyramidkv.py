"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV scores under budgets that shrink with depth.

Scoring is SnapKV's unchanged; the per-layer budgets (the paper's linear schedule, the configured
budget being the average over budgeted layers) come from ``sparsekv.kv_cache.budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsekv.compression.snapkv import SnapKVCompressor


@dataclass
class PyramidKVCompressor(SnapKVCompressor):
    """SnapKV scores; only the budgets differ (``layer_budgets`` applies the pyramid)."""

    name = "pyramidkv"
