"""Routing policies of the replica ingress: keys, affinity, threshold fallback, round robin."""

from __future__ import annotations

import pytest

from sparsekv.distributed.routing import (
    LeastLoadedRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
    make_router,
    routing_key,
)
from sparsekv.parallel_config import ParallelConfig

SHARED = list(range(100, 164))  # four pages of 16 tokens


def test_routing_key_hashes_full_pages_only():
    key = routing_key(SHARED + [1, 2, 3], block_size=16, max_pages=4)
    # The partial page (and anything past max_pages) does not count.
    assert key == routing_key(SHARED + [9, 9], block_size=16, max_pages=4)
    assert key == routing_key(SHARED + list(range(40)), block_size=16, max_pages=4)
    assert key != routing_key(SHARED[:-1] + [7], block_size=16, max_pages=4)
    assert len(key) == 16
    # Fewer full pages than max_pages: those pages are the key.
    assert routing_key(SHARED[:20], 16, 4) == routing_key(SHARED[:16] + [5] * 15, 16, 4)
    assert routing_key(SHARED[:20], 16, 4) != key
    # Less than one full page: nothing to route by.
    assert routing_key(SHARED[:15], 16, 4) is None
    assert routing_key([], 16, 4) is None


def test_routing_key_of_context_scope_is_the_shared_context():
    context = SHARED[:32]
    first = routing_key(context + [1] * 40, 16, 4, num_context_tokens=32)
    second = routing_key(context + [2] * 40, 16, 4, num_context_tokens=32)
    assert first == second == routing_key(context, 16, 4)
    # A context shorter than a page holds nothing to share.
    assert routing_key(context + [1] * 40, 16, 4, num_context_tokens=10) is None


def test_prefix_affinity_is_stable_and_spreads_keys():
    router = PrefixAffinityRouter(queue_threshold=4)
    keys = [routing_key([k] * 16, 16, 4) for k in range(64)]
    chosen = [router.choose(key, [0, 0, 0]) for key in keys]
    # The same key always gets the same replica, whatever the (low) loads.
    assert chosen == [router.choose(key, [3, 1, 2]) for key in keys]
    assert chosen == [PrefixAffinityRouter(4).choose(key, [0, 0, 0]) for key in keys]
    assert sorted(set(chosen)) == [0, 1, 2]
    # Rendezvous hashing: a fourth replica takes keys only for itself, never moves the others.
    moved = [(a, b) for a, b in zip(chosen, [router.choose(k, [0] * 4) for k in keys]) if a != b]
    assert moved and all(b == 3 for _, b in moved)


def test_prefix_affinity_yields_to_least_loaded_past_the_threshold():
    router = PrefixAffinityRouter(queue_threshold=2)
    key = routing_key(SHARED, 16, 4)
    home = router.preferred(key, 2)
    other = 1 - home
    loads = [0, 0]
    loads[home] = 2  # at the threshold: still home
    assert router.choose(key, loads) == home
    loads[home] = 3  # past it: the least-loaded replica
    assert router.choose(key, loads) == other
    loads[other] = 5  # past it, but home is now the least loaded
    assert router.choose(key, loads) == home
    # No key: least loaded, lowest index on ties.
    assert router.choose(None, [2, 1, 1]) == 1


def test_round_robin_and_least_loaded():
    router = RoundRobinRouter()
    key = routing_key(SHARED, 16, 4)
    assert [router.choose(key, [9, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert LeastLoadedRouter().choose(key, [3, 2, 2, 5]) == 1


def test_make_router_and_invalid_settings():
    assert isinstance(make_router("prefix", 3), PrefixAffinityRouter)
    assert make_router("prefix", 3).queue_threshold == 3
    assert isinstance(make_router("round_robin", 3), RoundRobinRouter)
    assert isinstance(make_router("least_loaded", 3), LeastLoadedRouter)
    with pytest.raises(ValueError, match="^routing_policy must be one of"):
        make_router("random", 3)
    with pytest.raises(ValueError, match="^routing_queue_threshold must be >= 1"):
        PrefixAffinityRouter(0)
    with pytest.raises(ValueError, match="^loads"):
        RoundRobinRouter().choose(None, [])


@pytest.mark.parametrize(
    "values, message",
    [
        ({"data_parallel_size": 0}, "^data_parallel_size must be >= 1"),
        ({"threads_per_rank": 0}, "^threads_per_rank must be >= 1"),
        ({"routing_policy": "hash"}, "^routing_policy must be one of"),
        ({"routing_queue_threshold": 0}, "^routing_queue_threshold must be >= 1"),
        ({"routing_prefix_pages": 0}, "^routing_prefix_pages must be >= 1"),
    ],
)
def test_parallel_config_rejects_invalid_values(values, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**values).validate()
