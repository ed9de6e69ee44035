"""The prefix cache and the page pool without a model: chained hashes, ref counts, reclaimable
pages, LRU eviction of whole groups, copy-on-write plans and the invariant checker."""

from __future__ import annotations

import pytest
import torch

from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.manager import KVCacheManager, KVPolicy
from sparsekv.kv_cache.prefix_cache import PrefixCache, page_digests
from sparsekv.kv_cache.spec import LayerSpec

BS = 4


def make_cache(num_pages: int = 32) -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(num_pages)
    return pool, PrefixCache(pool, BS)


def make_manager(num_pages: int = 64, num_layers: int = 2, **kw) -> KVCacheManager:
    specs = [LayerSpec()] * num_layers
    return KVCacheManager(
        specs, num_pages, BS, 1, 2, torch.float32, enable_prefix_caching=True, **kw
    )


def insert_request(pool: BlockPool, cache: PrefixCache, tokens: list[int], layers: int = 2):
    """A request that computed ``tokens`` and offers them; returns its per-layer tables."""
    tables = [pool.allocate(len(tokens) // BS) for _ in range(layers)]
    cache.insert(tokens, tables)
    return tables


def test_digests_chain_over_full_pages_only():
    tokens = list(range(10))
    digests = page_digests(tokens, BS)
    assert len(digests) == 2  # the partial third page has no key
    assert page_digests(tokens[:8], BS) == digests
    # The same page of tokens after a different prefix has a different key.
    other = page_digests([99, 1, 2, 3] + tokens[4:8], BS)
    assert other[1] != digests[1] and other[0] != digests[0]
    assert page_digests(tokens, BS, salt=b"policy")[0] != digests[0]
    assert all(len(d) == 16 for d in digests)


def test_insert_match_and_partial_hit():
    pool, cache = make_cache()
    tokens = list(range(12))
    tables = insert_request(pool, cache, tokens)
    assert cache.num_groups == 3
    assert all(pool.ref_count(p) == 2 for t in tables for p in t)  # request + cache
    assert len(cache.match(tokens, max_tokens=12)) == 3
    assert len(cache.match(tokens, max_tokens=11)) == 2  # capped, page-aligned
    assert len(cache.match(tokens[:6] + [77] * 6, max_tokens=12)) == 1  # diverges in page 1
    assert cache.match([5] + tokens[1:], max_tokens=12) == []
    # Inserting the same tokens again adds nothing and keeps one cache reference per page.
    assert cache.insert(tokens, [pool.allocate(3), pool.allocate(3)]) == 0


def test_reclaimable_pages_and_eviction_on_allocate():
    pool, cache = make_cache(num_pages=12)
    tables = insert_request(pool, cache, list(range(8)))  # 2 groups x 2 layers
    assert pool.num_free_pages == 8 and pool.num_reclaimable_pages == 0
    for table in tables:
        pool.free(table)
    assert pool.num_reclaimable_pages == 4 and pool.num_free_pages == 8
    pages = pool.allocate(10)  # needs two evicted pages: one whole group goes
    assert len(pages) == 10 and cache.num_groups == 1
    assert pool.num_reclaimable_pages == 2
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    pool.free(pages)


def test_eviction_never_frees_a_page_in_a_block_table():
    pool, cache = make_cache(num_pages=8)
    tables = insert_request(pool, cache, list(range(8)))
    pool.free(tables[1])  # layer 1 pages: cache only; layer 0 pages still held by the request
    pool.allocate(pool.num_free_pages)
    taken = pool.allocate(2)  # evicts both groups (each has a reclaimable page)
    assert cache.num_groups == 0
    assert all(pool.ref_count(p) == 1 for p in tables[0])  # the request keeps its pages
    assert set(taken) == set(tables[1])
    assert pool.num_reclaimable_pages == 0


def test_groups_held_by_requests_are_not_evicted():
    pool, cache = make_cache(num_pages=8)
    insert_request(pool, cache, list(range(8)))  # request still holds everything
    assert not cache.evict_one()
    with pytest.raises(RuntimeError):
        pool.allocate(5)
    assert cache.num_groups == 2


def test_lru_order_and_tail_first_release():
    pool, cache = make_cache(num_pages=64)
    a_tables = insert_request(pool, cache, [1] * 12)  # groups a0 a1 a2
    b_tables = insert_request(pool, cache, [2] * 8)  # groups b0 b1
    a = page_digests([1] * 12, BS)
    b = page_digests([2] * 8, BS)
    cache.release(a_tables)  # a released after b was inserted: a is newer, tail first
    for table in a_tables:
        pool.free(table)
    cache.release(b_tables)
    for table in b_tables:
        pool.free(table)
    assert [g.digest for g in cache.groups()] == [a[2], a[1], a[0], b[1], b[0]]
    cache.match([1] * 12, max_tokens=4)  # a hit touches a0 only
    assert [g.digest for g in cache.groups()][-1] == a[0]
    evicted = []
    while cache.num_groups:
        before = {g.digest for g in cache.groups()}
        assert cache.evict_one()
        evicted += list(before - {g.digest for g in cache.groups()})
    assert evicted == [a[2], a[1], b[1], b[0], a[0]]
    assert pool.num_free_pages == 64 and pool.num_reclaimable_pages == 0


def test_manager_attach_counts_reclaimable_as_free_and_checks_invariants():
    kv = make_manager(num_pages=32)
    kv.register("a", [None, None], KVPolicy())
    kv.commit("a", kv.allocate("a", 10, True, True), cache_token_ids=list(range(10)))
    assert kv.prefix_cache.num_groups == 2
    kv.free("a")
    assert kv.num_free_pages == 32 and kv.pool.num_reclaimable_pages == 4
    kv.check_invariants()
    kv.register("b", [None, None], KVPolicy())
    assert kv.attach_prefix("b", list(range(10)) + [5, 5], max_tokens=11) == 8
    assert kv.get("b").layers[1].num_slots == 8
    assert kv.num_free_pages == 28  # the hit pages are held again
    kv.check_invariants()
    kv.pool._ref_counts[kv.get("b").layers[0].block_table[0]] += 1  # corrupt a count
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_invariants()
    kv.pool._ref_counts[kv.get("b").layers[0].block_table[0]] -= 1
    kv.reset("b")  # detach
    assert kv.num_free_pages == 32 and kv.get("b").layers[0].num_slots == 0
    kv.free("b")
    kv.check_invariants()


def test_compaction_of_shared_pages_copies_on_write():
    kv = make_manager(num_pages=64)
    kv.register("a", [None, 13], KVPolicy())
    kv.commit("a", kv.allocate("a", 12, True, True), cache_token_ids=list(range(12)))  # 12 <= 13
    kv.free("a")
    kv.register("b", [None, 13], KVPolicy())
    assert kv.attach_prefix("b", list(range(12)) + [7] * 8, max_tokens=20 - 4) == 12
    shared = list(kv.get("b").layers[1].block_table)
    steps = kv.allocate("b", 8, True, True)  # layer 1 compresses 20 -> 13 slots
    assert steps[0].compact_table is None and steps[0].compress_to is None
    assert steps[1].compress_to == 13 and len(steps[1].compact_table) == 4
    assert not set(steps[1].compact_table) & set(shared)
    assert steps[1].block_table == shared  # no new page: nothing written uncompressed
    kv.check_invariants()
    kv.commit("b", steps)
    state = kv.get("b").layers[1]
    assert state.block_table == steps[1].compact_table and state.num_slots == 13
    assert all(kv.pool.ref_count(p) == 1 for p in shared)  # back to the cache alone
    kv.check_invariants()
    kv.free("b")


@pytest.mark.parametrize("num_pages", [64, 14])
def test_uncompressed_prompt_kept_only_when_the_pool_has_room(num_pages):
    kv = make_manager(num_pages=num_pages, prefix_cache_uncompressed=True)
    kv.register("a", [None, 9], KVPolicy())
    # The check half counts the plain plan (8 pages); keeping the uncompressed prompt needs
    # 13, plus a reserve of one page per layer and live request.
    assert kv.num_pages_needed("a", 20, True, True) == 5 + 3
    steps = kv.allocate("a", 20, True, True)
    wide = num_pages == 64
    assert steps[1].keep_uncompressed == wide
    assert (steps[1].compact_table is not None) == wide
    kv.commit("a", steps, cache_token_ids=list(range(20)))
    assert kv.prefix_cache.num_groups == (5 if wide else 0)
    assert kv.get("a").layers[1].num_slots == 9 and len(kv.get("a").layers[1].block_table) == 3
    # The budgeted layer's uncompressed pages are held by the cache alone: reclaimable.
    assert kv.pool.num_reclaimable_pages == (5 if wide else 0)
    kv.check_invariants()
    kv.free("a")
