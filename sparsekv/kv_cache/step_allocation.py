"""The act half of a step: take from the pool the pages its plan counted.

``KVCacheManager.plan_step`` (the check half) counts the pages each layer's plan adds; the
manager's ``allocate`` takes them with these helpers. A flat layer's block table grows to its
plan's capacity and a compacting layer gets its fresh compaction table; a head-wise layer grows
each KV head's pages (``head_pages.grow``). Before that, a compressing last prefill chunk may
widen its plan to keep its uncompressed prompt for the prefix cache, when the pool has room to
spare.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from sparsekv.kv_cache import head_pages
from sparsekv.kv_cache import prefix_sharing as sharing
from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.plan import KVPolicy, LayerPlan, StepPlan, pages_needed
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV
from sparsekv.kv_cache.spec import cdiv

ByKind = Callable[[Sequence[int]], list[int]]
Fits = Callable[[list[int], int], bool]


def side_pages_due(kv: RequestKV, policy: KVPolicy | None) -> int:
    """Side-state pages the request's next step takes (all of them on its first step, or
    back from a swap); ``None``: a caller registered no policy (none)."""
    return 0 if kv.side_pages or policy is None else policy.side_pages


def take_side_pages(pool: BlockPool, kv: RequestKV, policy: KVPolicy | None, kind: int) -> None:
    """Take the side pages (of page kind ``kind``) the request does not hold yet (its plan
    counted them)."""
    due = side_pages_due(kv, policy)
    if due:
        kv.side_pages = pool.allocate(due, kind)


def keeping_uncompressed(
    pool: BlockPool,
    kv: RequestKV,
    policy: KVPolicy,
    plan: StepPlan,
    num_new: int,
    block_size: int,
    by_kind: ByKind,
    fits: Fits,
    reserve: int,
) -> StepPlan:
    """The act half's plan of the step that completes a prompt, when the manager keeps
    uncompressed prompts (``prefix_cache_uncompressed``): a compressing last prefill chunk
    also keeps its uncompressed prompt for the prefix cache; otherwise ``plan`` unchanged.

    Never for a policy with bounded chunks or a context-only scope. The widened plan is taken
    only when the prompt has full pages the cache lacks
    (``prefix_sharing.may_keep_uncompressed``) and its extra pages leave ``reserve`` pages to
    spare in each kind they draw from: the check half counts the plain plan, so the act half
    never needs more than the check allowed, and a short pool falls back silently.

    Args:
        pool: the page pool.
        kv: the request's state.
        policy: the request's KV policy.
        plan: the check half's plan of the step.
        num_new: tokens the step writes.
        block_size: slots per page.
        by_kind: per-layer page counts summed per page kind.
        fits: whether the pool has the given pages per kind plus a watermark in each kind
            that needs any.
        reserve: pages the widened plan must leave in each kind it draws from.
    """
    if policy.bounded_chunks or policy.context_only:
        return plan
    plans = plan.layers
    if not sharing.may_keep_uncompressed(pool, kv, plans, num_new, block_size):
        return plan
    wide = [
        p if p.compress_to is None else p.keeping_uncompressed(s.num_held + num_new)
        for p, s in zip(plans, kv.layers)
    ]
    layer_pages = pages_needed(wide, kv.layers, block_size)
    num_pages = by_kind(layer_pages)
    if fits(num_pages, reserve):
        return StepPlan(wide, num_pages, layer_pages)
    return plan


def allocate_layers(
    pool: BlockPool,
    layer_kinds: Sequence[int],
    layers: list[LayerKV],
    plan: StepPlan,
    block_size: int,
) -> None:
    """Take every layer's pages of ``plan`` from the pool of its kind.

    Args:
        pool: the page pool (evicts unreferenced prefix-cache groups when a free list runs
            short).
        layer_kinds: the page kind of each layer.
        layers: the request's per-layer state; tables extended in place.
        plan: the step's plan (``plan.layer_pages``: pages each layer adds).
        block_size: slots per page.

    Raises:
        RuntimeError: the pool lacks pages (``BlockPool.allocate``).
    """
    for kind, state, layer, num_pages in zip(layer_kinds, layers, plan.layers, plan.layer_pages):
        if layer.head_growth is not None:
            if num_pages:
                allocate = functools.partial(pool.allocate, kind=kind)
                head_pages.grow(state, layer.head_growth, allocate)
        elif num_pages or layer.fresh_compact:  # most decode steps add no page to a layer
            _allocate_layer(pool, kind, state, layer, block_size)


def _allocate_layer(
    pool: BlockPool, kind: int, state: LayerKV, layer: LayerPlan, block_size: int
) -> None:
    """Extend a layer's table to its plan's capacity and take its fresh compaction pages."""
    extra = cdiv(layer.capacity, block_size) - len(state.block_table)
    if extra > 0:
        state.block_table.extend(pool.allocate(extra, kind))
    if layer.fresh_compact:
        num = cdiv(layer.compress_to, block_size) + layer.compact_slack
        state.compact_table = pool.allocate(num, kind)
