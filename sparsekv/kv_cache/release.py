"""A request's pages going back to the pool, and coming back after a swap.

A finishing request frees all it holds; a recompute preemption (or undoing an attach) drops its
pages and clears its layer state but keeps the registration; a swap preemption copies its pages
to host memory before dropping them, and the swap-in restores the copies into freshly allocated,
private pages. Pages a block table shares with the prefix cache or other requests only lose
this request's reference. ``KVCacheManager`` calls these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.prefix_cache import PrefixCache
from sparsekv.kv_cache.request_kv import RequestKV
from sparsekv.kv_cache.storage import KVStorage

Release = Callable[[list[list[int]]], None]
StorageOf = Callable[[int], KVStorage]


def release_tables(pool: BlockPool, cache: PrefixCache | None, tables: list[list[int]]) -> None:
    """Drop a request's reference on each page of ``tables``; with a prefix cache, the cache
    first releases the cached groups they hold (tail first)."""
    if cache is not None:
        cache.release(tables)
    for table in tables:
        pool.free(table)


def drop_tables(release: Release, kv: RequestKV) -> None:
    """Release every layer's block table and compaction table in flight; the tables are left
    empty."""
    tables = [state.block_table for state in kv.layers]
    tables += [state.compact_table for state in kv.layers if state.compact_table]
    release(tables)
    for state in kv.layers:
        state.block_table, state.compact_table = [], None


def drop_side_pages(pool: BlockPool, kv: RequestKV) -> None:
    """Free the request's side-state pages."""
    pool.free(kv.side_pages)
    kv.side_pages = []


def clear_layers(kv: RequestKV) -> None:
    """Zero every layer's slot counters and drop its scoring state, int4 residual and
    head-wise split (the layer budgets stay)."""
    for state in kv.layers:
        state.num_slots = state.first_slot = state.num_evicted = 0
        state.recent_queries = state.accumulated = state.residual = None
        state.head_lens = state.head_pages = None


def swap_out(pool: BlockPool, release: Release, kv: RequestKV, storage_of: StorageOf) -> None:
    """Copy the request's pages to host memory (``kv.swapped_pages``) and drop its references.

    The round trip is bit-exact (codes and scales); shared pages are copied like any other and
    stay with their other holders; int4 residuals stay in the layer state.

    Args:
        pool: the page pool (takes back the side pages).
        release: drops a request's reference on whole tables (the manager's, which tells the
            prefix cache first).
        kv: the request's state.
        storage_of: the page storage of a layer index.
    """
    copies = [
        storage_of(layer).read_pages(state.block_table) for layer, state in enumerate(kv.layers)
    ]
    drop_tables(release, kv)
    # The side state goes to host memory with the K/V copies (it stays in the layer state;
    # host memory is not the pool's): a swapped request holds no page, so the request at
    # the head of the queue always fits an idle engine.
    drop_side_pages(pool, kv)
    kv.swapped_pages = copies


def swapped_layer_pages(kv: RequestKV) -> list[int]:
    """Pages each layer of a swapped request needs to come back (none when not swapped)."""
    return [copy[0].shape[0] for copy in kv.swapped_pages or []]


def swap_in(
    pool: BlockPool, kv: RequestKV, storage_of: StorageOf, layer_kinds: Sequence[int]
) -> None:
    """Restore a swapped request's pages into freshly allocated (private) pages of each
    layer's kind and forget the host copies.

    Raises:
        RuntimeError: the pool lacks pages (check the per-kind counts first).
    """
    for layer, (state, copy) in enumerate(zip(kv.layers, kv.swapped_pages)):
        state.block_table = pool.allocate(copy[0].shape[0], layer_kinds[layer])
        storage_of(layer).write_pages(state.block_table, copy)
    kv.swapped_pages = None
