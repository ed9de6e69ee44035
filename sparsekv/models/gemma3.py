"""Gemma 3 text (Gemma Team 2025, "Gemma 3 Technical Report", arXiv 2503.19786).

Gemma 3 is the shared decoder (``sparsekv.models.decoder``) with q/k RMSNorm, Gemma's
``1 + w`` norms and sandwich norms, GeGLU, scaled embeddings, ``query_pre_attn_scalar``, a RoPE
base per layer type and interleaved local (sliding-window) and global layers from
``config.layer_types`` (5 local : 1 global in the released models). This module keeps the
family's names for code that refers to them.
"""

from __future__ import annotations

from sparsekv.models.decoder import DecoderForCausalLM, text_config
from sparsekv.models.variant import FULL, SLIDING

__all__ = ["FULL", "SLIDING", "Gemma3ForCausalLM", "layer_types", "text_config"]


def layer_types(config) -> list[str]:
    """Per-layer ``sliding_attention`` / ``full_attention``.

    Uses ``config.layer_types``; configs without it fall back to ``sliding_window_pattern``
    (every ``pattern``-th layer is global, the others local; 6 in Gemma 3).
    """
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None)
    pattern = pattern or getattr(config, "_sliding_window_pattern", None) or 6
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


class Gemma3ForCausalLM(DecoderForCausalLM):
    """The shared decoder built from a ``Gemma3TextConfig`` (or a ``Gemma3Config``: its text
    part); see :class:`DecoderForCausalLM` for the arguments."""
