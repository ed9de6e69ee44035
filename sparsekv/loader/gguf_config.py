"""What transformers' GGUF config reader leaves out, restored from the GGUF metadata.

transformers maps the common keys (sizes, heads, RoPE base) but not everything a family's
math depends on; llama.cpp's converter stores the rest under its own keys or as tensors:

- every architecture: ``head_dim`` from ``<arch>.attention.key_length`` (Qwen3's is
  independent of ``hidden_size / num_heads``; transformers' Qwen3 reader drops it);
- ``phi3``: the longrope short / long factors (tensors ``rope_factors_short`` /
  ``rope_factors_long``), the original context and the partial rotary dimension
  (``phi3.rope.dimension_count``); a sliding window of 0 means none.
- ``gemma2``: the attention and final logit soft-caps and the sliding window. The converter
  does not store ``query_pre_attn_scalar``; llama.cpp scales by ``head_dim ** -0.5``, which is
  what Gemma 2 2B and 9B use, and so does this.
"""

from __future__ import annotations

import copy

import numpy as np
from gguf.quants import dequantize

from sparsekv.loader.gguf_file import GGUFFile


def complete_config(gguf: GGUFFile, config):
    """A copy of ``config`` with the family keys transformers' reader dropped (module doc)."""
    config = copy.deepcopy(config)
    key_length = gguf.metadata.get(f"{gguf.architecture}.attention.key_length")
    if key_length:
        config.head_dim = int(key_length)
    fix = _FIXES.get(gguf.architecture)
    if fix is not None:
        fix(gguf, config)
    return config


def _tensor(gguf: GGUFFile, name: str) -> list[float] | None:
    info = gguf.tensors.get(name)
    if info is None:
        return None
    values = dequantize(gguf.raw_data(info), info.qtype)
    return [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]


def _phi3(gguf: GGUFFile, config) -> None:
    meta = gguf.metadata
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = int(meta.get("phi3.rope.dimension_count", head_dim))
    params = {
        "rope_type": "default",
        "rope_theta": float(meta.get("phi3.rope.freq_base", 10000.0)),
        "partial_rotary_factor": rotary / head_dim,
    }
    long_factor = _tensor(gguf, "rope_factors_long.weight")
    short_factor = _tensor(gguf, "rope_factors_short.weight")
    original = meta.get("phi3.rope.scaling.original_context_length")
    if long_factor is not None and short_factor is not None and original:
        params.update(
            rope_type="longrope",
            original_max_position_embeddings=int(original),
            long_factor=long_factor,
            short_factor=short_factor,
        )
        config.original_max_position_embeddings = int(original)
    config.rope_parameters = params
    window = int(meta.get("phi3.attention.sliding_window", 0) or 0)
    config.sliding_window = window or None


def _gemma2(gguf: GGUFFile, config) -> None:
    meta = gguf.metadata
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.get(f"gemma2.{key}")
        setattr(config, key, float(value) if value else None)
    window = meta.get("gemma2.attention.sliding_window")
    if window:
        config.sliding_window = int(window)
    head_dim = int(meta.get("gemma2.attention.key_length", config.head_dim))
    config.head_dim = head_dim
    config.query_pre_attn_scalar = head_dim


_FIXES = {"phi3": _phi3, "gemma2": _gemma2}
