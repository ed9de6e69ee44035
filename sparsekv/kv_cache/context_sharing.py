"""Compressed contexts in the prefix cache (``--compression-scope context``).

A request whose context was compressed once publishes it under a key; later requests with the
same key attach it instead of prefilling and compressing again. Full pages are shared (the
pool counts their holders); each layer's partial last page, and the int4 residual, are copied,
because the next tokens write into them. ``KVCacheManager`` calls these helpers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.prefix_cache import ContextLayer, PrefixCache
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.storage import KVStorage

StorageOf = Callable[[int], KVStorage]


def publish(
    cache: PrefixCache,
    layers: list[LayerKV],
    storage_of: StorageOf,
    key: bytes,
    num_tokens: int,
    block_size: int,
) -> bool:
    """Cache a request's just-compressed context under ``key``; takes no page.

    Args:
        cache: the prefix cache.
        layers: the request's per-layer state.
        storage_of: the page storage of a layer index (reads the partial last pages).
        key: the context's digest.
        num_tokens: the context's length in tokens.
        block_size: slots per page.

    Returns:
        Whether it was cached: not when the key is cached, or a layer has slid, compacts,
        or holds head-wise pages.
    """
    cached = []
    for layer, state in enumerate(layers):
        if state.first_slot or state.compact_table is not None or state.head_lens:
            return False
        num_full = state.num_held // block_size
        tail = None
        if state.num_held % block_size:
            tail = storage_of(layer).read_pages([state.block_table[num_full]])
        full = state.block_table[:num_full]
        residual = clone_pair(state.residual)
        cached.append(ContextLayer(full, state.num_slots, state.num_evicted, tail, residual))
    return cache.insert_context(key, num_tokens, cached)


def attach(
    cache: PrefixCache,
    pool: BlockPool,
    layers: list[LayerKV],
    storage_of: StorageOf,
    layer_kinds: list[int],
    fits: Callable[[list[int]], bool],
    key: bytes,
) -> int:
    """Give an empty request the cached context of ``key``: its full pages (shared) and a
    private copy of each partial last page (one fresh page per such layer).

    Args:
        cache, pool: the prefix cache and the page pool.
        layers: the request's per-layer state, empty; filled in place.
        storage_of: the page storage of a layer index (writes the copies).
        layer_kinds: the page kind of each layer.
        fits: whether the pool has, per layer, the given number of pages.
        key: the context's digest.

    Returns:
        The context's length in tokens, or 0 (not cached, or no room for the copies).
    """
    entry = cache.lookup_context(key)
    if entry is None:
        return 0
    assert all(not state.block_table for state in layers), "attach to a non-empty request"
    # Hold the shared pages first: the copies' allocation may evict cached groups.
    for info in entry.layers:
        pool.incref(info.full_pages)
    if not fits([int(info.tail is not None) for info in entry.layers]):
        for info in entry.layers:
            pool.free(info.full_pages)
        return 0
    for layer, (state, info) in enumerate(zip(layers, entry.layers)):
        table = list(info.full_pages)
        if info.tail is not None:
            table += pool.allocate(1, layer_kinds[layer])
            storage_of(layer).write_pages(table[-1:], info.tail)
        state.block_table = table
        state.num_slots, state.num_evicted = info.num_slots, info.num_evicted
        state.residual = clone_pair(info.residual)
    return entry.num_tokens


def clone_pair(
    pair: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A private copy of an int4 layer's residual (keys, values), or ``None``."""
    return None if pair is None else (pair[0].clone(), pair[1].clone())
