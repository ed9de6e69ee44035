"""Side state paid for with pool pages (``kv_cache.side_state``): a compressing request holds
its side-state pages from its first step to its end, except while swapped out, and a
full-cache request holds none, so ``--kv-cache-memory`` becomes pages whole."""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig
from sparsekv.engine import engine_setup
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.kv_cache.policy import resolve_policy
from sparsekv.kv_cache.side_state import side_pages, side_state_bytes
from sparsekv.kv_cache.spec import LayerSpec

BS = 16
FULL_CACHE = EngineConfig(compression=CompressionConfig(method="none"))
# SmolLM2-135M's attention: 9 query heads, 3 KV heads of 64.
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def manager(num_pages: int = 2000, num_layers: int = 4, **kw) -> KVCacheManager:
    return KVCacheManager(
        [LayerSpec()] * num_layers, num_pages, BS, KV_HEADS, HEAD_DIM, torch.bfloat16,
        num_heads=HEADS, **kw,
    )  # fmt: skip


def test_bytes_count_window_queries_masses_and_int4_residuals():
    geometry = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BS)
    # Two budgeted layers' fp32 window queries [9, 32, 64].
    assert side_state_bytes([None, 100, 100], window=32, **geometry) == 2 * 9 * 32 * 64 * 4
    # A full cache keeps nothing, whatever the window.
    assert side_state_bytes([None] * 3, window=32, **geometry) == 0
    # Masses [3, 500] per budgeted layer and int4 residuals 2 x [3, 16, 64] per int4 layer.
    with_all = side_state_bytes([7], window=8, num_int4_layers=2, mass_slots=500, **geometry)
    assert with_all == 4 * (9 * 8 * 64 + 3 * 500 + 2 * 2 * 3 * 16 * 64)
    assert side_pages(0, 12288) == 0
    assert side_pages(1, 12288) == side_pages(12288, 12288) == 1
    assert side_pages(12289, 12288) == 2
    with pytest.raises(ValueError, match="page_bytes"):
        side_pages(10, 0)


def test_a_compressing_request_holds_its_side_pages_from_the_first_step_to_the_end():
    kv = manager()
    config = EngineConfig(compression=CompressionConfig(budget=64, window=32, full_layers=1))
    policy = resolve_policy(config, None, kv, 300, 10)
    # 3 budgeted layers x [9, 32, 64] fp32 = 221184 B over 12288-byte bf16 pages: 18 pages.
    assert kv.page_bytes == 2 * 3 * 16 * 64 * 2
    assert policy.kv.side_pages == 18
    full = resolve_policy(FULL_CACHE, None, kv, 300, 10)
    assert full.kv.side_pages == 0
    kv.register("c", list(policy.layer_budgets), policy.kv)
    kv.register("f", list(full.layer_budgets), full.kv)
    total = kv.num_free_pages
    plan = kv.plan_step("c", 128, False, True)
    # Four layers' 8 pages each, plus the side pages on the first step only.
    assert plan.num_pages == [4 * 8 + 18]
    kv.allocate("c", 128, False, True, plan)
    assert len(kv.get("c").side_pages) == 18
    assert kv.num_free_pages == total - 4 * 8 - 18
    # (Nothing committed yet: 144 new slots need one more page per layer, no side pages.)
    assert kv.plan_step("c", 144, False, True).num_pages == [4 * 1]
    kv.allocate("f", 16, False, True)
    assert kv.get("f").side_pages == []
    kv.check_invariants()
    # A swap returns the side pages with the K/V pages (swapped state is host memory) and
    # takes them back with them.
    kv.swap_out("c")
    assert kv.get("c").side_pages == []
    assert kv.num_free_pages == total - 4
    assert kv.num_swap_in_pages("c") == 4 * 8 + 18
    kv.check_invariants()
    kv.swap_in("c")
    assert len(kv.get("c").side_pages) == 18
    assert kv.num_free_pages == total - 4 * 8 - 18 - 4
    kv.check_invariants()
    kv.free("c")
    kv.free("f")
    assert kv.num_free_pages == total
    kv.check_invariants()


def test_a_reset_request_takes_its_side_pages_again_with_its_next_step():
    kv = manager()
    config = EngineConfig(compression=CompressionConfig(budget=64, window=32, full_layers=0))
    policy = resolve_policy(config, None, kv, 300, 10)
    kv.register("c", list(policy.layer_budgets), policy.kv)
    total = kv.num_free_pages
    kv.allocate("c", 64, False, True)
    kv.reset("c")
    assert kv.num_free_pages == total and kv.get("c").side_pages == []
    assert kv.plan_step("c", 64, False, True).num_pages == [4 * 4 + policy.kv.side_pages]


def test_the_peak_counts_the_side_pages_against_the_pool():
    config = EngineConfig(compression=CompressionConfig(budget=64, window=32, full_layers=0))
    # 4 layers x 5 pages (64 + 10 slots) fit 25 pages; the side state's 24 pages do not (nor
    # with one output token: the prompt is named).
    with pytest.raises(ValueError, match=r"^prompt: its 300 tokens need 44 KV pages at the peak"):
        resolve_policy(config, None, manager(num_pages=25), 300, 10)
    # A full cache of 64 slots: 4 x 4 pages, nothing else.
    assert resolve_policy(FULL_CACHE, None, manager(num_pages=25), 60, 4).peak_pages == (16,)


def test_the_pool_takes_the_whole_kv_cache_memory():
    config = EngineConfig(cache=CacheConfig(kv_cache_memory=1.0))
    pages = engine_setup.num_pool_pages(config, 30, KV_HEADS, HEAD_DIM, torch.bfloat16)
    # SmolLM2-135M in bf16: 12288-byte pages, 1 GiB = 87381 of them (46603 slots per layer).
    assert pages == (1 << 30) // 12288 == 87381


def test_swapped_requests_hold_no_page_so_the_queue_head_fits_an_idle_pool():
    """With every request swapped out the pool is whole again: the head of the queue (whose
    peak, side pages included, was checked against the pool) always swaps back in."""
    kv = manager(num_pages=100, num_layers=1)
    config = EngineConfig(compression=CompressionConfig(budget=64, window=32, full_layers=0))
    for name in ("a", "b"):
        policy = resolve_policy(config, None, kv, 600, 200)
        assert policy.kv.side_pages == 6  # 1 layer x [9, 32, 64] fp32 = 73728 B
        kv.register(name, list(policy.layer_budgets), policy.kv)
    kv.allocate("a", 600, True, True)  # compresses: 64 slots kept
    kv.allocate("b", 512, False, True)
    kv.swap_out("b")
    kv.swap_out("a")
    assert kv.num_free_pages == 100
    kv.check_invariants()
    assert kv.can_swap_in("a") and kv.num_swap_in_pages("a") > 6
    kv.swap_in("a")
    assert len(kv.get("a").side_pages) == 6
    kv.check_invariants()


def test_side_pages_come_from_the_pool_that_holds_the_most_bytes():
    # fp8 pages with 3 of 4 layers in full precision: the quantized pool (1 layer's share) is
    # small, the side state is paid with full-precision pages instead.
    kv = manager(num_pages=(60, 180), kv_cache_dtype="fp8", full_precision_layers=(1, 2, 3))
    assert kv.side_kind == 1 and kv.side_page_bytes == 12288
    config = EngineConfig(compression=CompressionConfig(budget=64, window=32, full_layers=0))
    policy = resolve_policy(config, None, kv, 300, 10)
    # 4 budgeted layers x [9, 32, 64] fp32 = 294912 B over 12288-byte pages: 24 pages.
    assert policy.kv.side_pages == 24
    # Per kind: 1 layer x 5 pages; 3 layers x 5 pages + the side pages.
    assert policy.peak_pages == (5, 3 * 5 + 24)
    kv.register("c", list(policy.layer_budgets), policy.kv)
    assert kv.plan_step("c", 128, False, True).num_pages == [8, 3 * 8 + 24]
    kv.allocate("c", 128, False, True)
    assert kv.pool.num_available(0) == 60 - 8 and kv.pool.num_available(1) == 180 - 24 - 24
    kv.check_invariants()
    kv.free("c")
    assert kv.pool.num_available(1) == 180
    # Mostly quantized: the quantized pool holds the most bytes and pays.
    mostly = manager(num_pages=(180, 60), kv_cache_dtype="fp8", full_precision_layers=(3,))
    assert mostly.side_kind == 0


def test_a_prompt_fits_a_mostly_full_precision_cache_it_fits_in_full_precision():
    config = EngineConfig(compression=CompressionConfig(budget=64, window=32, full_layers=0))
    full = manager(num_pages=240)
    quantized = manager(num_pages=(60, 180), kv_cache_dtype="fp8", full_precision_layers=(1, 2, 3))
    for kv in (full, quantized):
        assert sum(resolve_policy(config, None, kv, 750, 2).peak_pages) <= 240


def test_every_layer_in_full_precision_is_named():
    with pytest.raises(ValueError, match="^kv_cache_full_precision_layers: lists every layer"):
        manager(num_pages=(10, 10), kv_cache_dtype="int8", full_precision_layers=(0, 1, 2, 3))
    config = EngineConfig(
        cache=CacheConfig(kv_cache_dtype="int4", kv_cache_full_precision_layers=(0, 1, 2))
    )
    with pytest.raises(ValueError, match="lists every layer \\(3\\), so no layer is int4"):
        engine_setup.num_pool_pages(config, 3, KV_HEADS, HEAD_DIM, torch.bfloat16)
