"""KV cache compressors: one small class per method, shared top-k mechanics in the base.

Methods and when to use them: docs/compression.md; the interface: docs/design.md
("Compression").
"""

from sparsekv.compression.base import Compressor, LayerView, top_indices_prefer_recent
from sparsekv.compression.registry import (
    COMPRESSORS,
    compressor_class,
    get_compressor,
    register_compressor,
)
from sparsekv.compression.scoring import (
    aggregate_gqa,
    attention_mass_per_head,
    pool_scores,
    prefill_attention_mass,
    window_attention_scores,
)

__all__ = [
    "COMPRESSORS",
    "Compressor",
    "LayerView",
    "aggregate_gqa",
    "attention_mass_per_head",
    "compressor_class",
    "get_compressor",
    "pool_scores",
    "prefill_attention_mass",
    "register_compressor",
    "top_indices_prefer_recent",
    "window_attention_scores",
]
