"""How many KV pages the engine's pool gets.

``--kv-cache-memory`` GiB (unset: sized from the device, ``engine.device_memory``) all becomes
pages, each counted at its stored size (codes and scales of a quantized
``--kv-cache-dtype``); the side state a request keeps outside its pages (stored window
queries, attention masses, int4 residuals) is paid for with pool pages it holds while it
lives (``kv_cache.side_state``), so a full-cache request has the whole size. With
full-precision layers beside quantized ones the page bytes are split between the two pools in
proportion to their layer counts, so both run out together, and the side state is paid with
pages of the pool that holds the most bytes. A size above 80% of the available
RAM is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparsekv.config import EngineConfig
from sparsekv.engine.device_memory import GIB, kv_cache_gib
from sparsekv.kv_cache.page_store import every_layer_full_precision
from sparsekv.kv_cache.storage import page_bytes


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def full_precision_layers(config: EngineConfig, num_layers: int) -> list[int]:
    """Layers kept at full precision (none unless the format is quantized).

    Raises:
        ValueError: a layer index past the model's layers, or every layer listed.
    """
    layers = sorted(set(config.cache.kv_cache_full_precision_layers or ()))
    if config.cache.kv_cache_dtype == "auto":
        return []
    if layers and layers[-1] >= num_layers:
        raise ValueError(
            f"kv_cache_full_precision_layers: layer {layers[-1]} but the model has {num_layers}"
        )
    if len(layers) == num_layers:
        raise ValueError(every_layer_full_precision(num_layers, config.cache.kv_cache_dtype))
    return layers


def num_pool_pages(
    config: EngineConfig,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    memory_gib: float | None = None,
) -> int | tuple[int, int]:
    """Pages that fit in ``memory_gib`` (default ``kv_cache_memory``, else the CPU default):
    one count, or (quantized pages, full-precision pages) when some layers stay at full
    precision. Requests pay for their side state with pages of this pool
    (``kv_cache.side_state``).

    Raises:
        ValueError: the size exceeds 80% of available RAM or leaves no room for pages.
    """
    num_full = len(full_precision_layers(config, num_layers))
    if config.cache.num_pages is not None:
        if not num_full:
            return config.cache.num_pages
        # An exact pool for tests: split by layer count, at least one page per layer each.
        quantized = config.cache.num_pages * (num_layers - num_full) // num_layers
        return max(quantized, num_layers - num_full), max(
            config.cache.num_pages - quantized, num_full
        )
    if memory_gib is None:
        memory_gib = kv_cache_gib(config, "cpu")
    total = int(memory_gib * GIB)
    available = available_memory_bytes()
    if available is not None and total > 0.8 * available:
        raise ValueError(
            f"kv_cache_memory: {memory_gib:g} GiB exceeds 80% of the "
            f"{available / GIB:.1f} GiB of available memory"
        )
    geometry = (num_kv_heads, config.cache.block_size, head_dim, dtype)
    quantized_bytes = page_bytes(config.cache.kv_cache_dtype, *geometry)
    if num_full:
        # Pages per layer are equal in both pools: n * (Lq * bytes_q + Lf * bytes_f) = total.
        full_bytes = page_bytes("auto", *geometry)
        per_layer = total // ((num_layers - num_full) * quantized_bytes + num_full * full_bytes)
        if per_layer < 1:
            raise ValueError(
                f"kv_cache_memory: {memory_gib:g} GiB holds fewer than one "
                f"page per layer ({num_layers})"
            )
        return int(per_layer * (num_layers - num_full)), int(per_layer * num_full)
    pages = total // quantized_bytes
    if pages < num_layers:
        raise ValueError(
            f"kv_cache_memory: {memory_gib:g} GiB holds {pages} pages, "
            f"fewer than one per layer ({num_layers})"
        )
    return int(pages)
