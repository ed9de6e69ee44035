"""The one startup line that sums up the engine's effective configuration.

``LLMEngine`` logs it once its parts are built (server, offline ``LLM`` and ``sparsekv
generate`` alike), so a user can check that their flags took effect: what was resolved
(``auto`` dtypes, the pool's page count, prefix caching turned off for a sliding-window model)
is shown, not what was asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsekv.compression_config import CompressionConfig
from sparsekv.config import EngineConfig
from sparsekv.engine.device_memory import GIB


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def compression_summary(settings: CompressionConfig) -> str:
    """The engine's default compression policy in a few words: ``none`` when it removes
    nothing, else the method, its budget (``budget N``, ``ratio R``, ``layer budgets`` or
    ``layer fractions``), the observation window and a non-default scope."""
    if not settings.enabled:
        return "none"
    if settings.layer_budgets is not None:
        budget = "layer budgets"
    elif settings.layer_fractions is not None:
        budget = "layer fractions"
    elif settings.compression_ratio is not None:
        budget = f"ratio {settings.compression_ratio:g}"
    elif settings.budget is not None:
        budget = f"budget {settings.budget}"
    else:
        budget = "no budget"
    scope = f", scope {settings.scope}" if settings.scope != "prompt" else ""
    return f"{settings.method} ({budget}, window {settings.window}{scope})"


def format_engine_summary(
    config: EngineConfig,
    model_name: str,
    dtype: torch.dtype,
    pool_pages: Sequence[int],
    pool_bytes: int,
    full_precision_layers: Sequence[int],
    prefix_caching: bool,
    num_threads: int,
) -> str:
    """The startup line of an engine's effective configuration (pure: no engine needed).

    Args:
        config: the engine configuration (weight and KV dtypes, block size, compression,
            scheduler limits).
        model_name: the served model name.
        dtype: the resolved compute dtype (``auto`` is shown as what it resolved to, and so
            are the ``auto`` weight and KV cache dtypes, which follow it).
        pool_pages: pages per page kind (kind 0: the ``kv_cache_dtype`` pages; kind 1, where
            some layers stay in full precision: their pages).
        pool_bytes: bytes of the whole pool, every kind.
        full_precision_layers: layers kept in full precision under a quantized KV dtype.
        prefix_caching: whether prefix caching is on (off for sliding-window models).
        num_threads: ``torch.get_num_threads()``.

    Returns:
        e.g. ``engine config: model smollm2-135m-instruct, dtype float32, weights float32,
        kv cache float32, kv pool 5461 pages (0.25 GiB, block size 16), compression snapkv
        (budget 1024, window 32), prefix caching on, max_num_seqs 64, max_num_batched_tokens
        4096, torch threads 2`` (one line).
    """
    compute = dtype_name(dtype)
    weights = compute if config.model.weight_dtype == "auto" else config.model.weight_dtype
    kv_dtype = compute if config.cache.kv_cache_dtype == "auto" else config.cache.kv_cache_dtype
    kv_cache = kv_dtype
    if full_precision_layers:
        layers = ",".join(str(layer) for layer in full_precision_layers)
        kv_cache += f" (full-precision layers {layers})"
    if len(pool_pages) > 1:  # kind 0 holds the KV dtype's pages, kind 1 full-precision ones
        pages = " + ".join(f"{n} {kind}" for n, kind in zip(pool_pages, (kv_dtype, compute)))
    else:
        pages = str(sum(pool_pages))
    scheduler = config.scheduler
    return (
        f"engine config: model {model_name}, dtype {compute}, weights {weights}, "
        f"kv cache {kv_cache}, kv pool {pages} pages ({pool_bytes / GIB:.2f} GiB, "
        f"block size {config.cache.block_size}), "
        f"compression {compression_summary(config.compression)}, "
        f"prefix caching {'on' if prefix_caching else 'off'}, "
        f"max_num_seqs {scheduler.max_num_seqs}, "
        f"max_num_batched_tokens {scheduler.max_num_batched_tokens}, "
        f"torch threads {num_threads}"
    )


def engine_summary(config: EngineConfig, parts) -> str:
    """``format_engine_summary`` of built ``EngineParts`` (the pool and prefix cache of
    ``parts.kv``, the current torch thread count)."""
    kv = parts.kv
    sizes = list(kv.pool.kind_sizes)
    pool_bytes = sum(size * storage.page_bytes for size, storage in zip(sizes, kv.storages))
    full = [layer for layer, kind in enumerate(kv.layer_kinds) if kind == 1]
    return format_engine_summary(
        config,
        parts.model_name,
        parts.dtype,
        sizes,
        pool_bytes,
        full,
        kv.prefix_cache is not None,
        torch.get_num_threads(),
    )
