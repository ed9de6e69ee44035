"""Per-layer step plans: what each layer of a request holds, writes and keeps in one step.

Pure functions of each layer's counters, the request's policy and which pages are shared; the KV manager checks a step's plans against the pool
(``KVCacheManager.plan_step``), turns them into page allocations (``allocate``) and the runner
reads the resulting ``LayerStep``s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from sparsekv.kv_cache import head_pages
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import cdiv


@dataclass(slots=True)
class LayerStep:
    """What one layer of one request does in a step (part of ``SchedulerOutput``).

    Attributes:
        block_table: page ids after this step's allocation.
        first_slot: logical slot of ``block_table[0]``.
        num_held: slots held before the step (``num_slots - first_slot``).
        num_new: new tokens whose K/V this layer receives.
        compress_to: if set, after attention the layer keeps exactly this many slots, chosen by
            the request's compressor over held + new slots.
        compact_table: if set, fresh pages that receive the compacted K/V instead of
            ``block_table`` (copy-on-write of shared pages, or the uncompressed prompt kept for
            the prefix cache); after the step it becomes the layer's table.
        keep_uncompressed: also write the new K/V uncompressed into ``block_table`` before
            compacting (the prefix cache keeps them, ``prefix_cache_uncompressed``).
        decode_compaction: a decode step that compacts (decode-time eviction): the new token's
            K/V go into ``block_table`` and its attention runs on the batched decode path like
            any decode; the layer is then re-scored over its ``num_held + 1`` paged slots and
            compacted to ``compress_to``.
        to_heads: the compaction splits ``num_kv_heads * compress_to`` slots among the KV
            heads by score into head-wise pages (``kv_cache.head_pages``; adaptive head
            budgets); the runner records the split in the layer state.
        head_lens, head_pages: a head-wise layer's held slots and pages per KV head before
            the step (its new tokens append to every head); ``None`` for other layers.
    """

    block_table: list[int]
    first_slot: int
    num_held: int
    num_new: int
    compress_to: int | None = None
    compact_table: list[int] | None = None
    keep_uncompressed: bool = False
    decode_compaction: bool = False
    to_heads: bool = False
    head_lens: tuple[int, ...] | None = None
    head_pages: tuple[int, ...] | None = None


@dataclass
class KVPolicy:
    """How a request's budgeted layers behave (resolved from its compression config).

    ``head_wise``: adaptive head budgets; a compressing layer splits its budget among its KV
    heads into head-wise pages (``kv_cache.head_pages``). ``side_pages``: pool pages held
    for the request's side state while it lives (``kv_cache.side_state``)."""

    decode_eviction: bool = True
    bounded_chunks: bool = False
    context_only: bool = False  # scope "context": compress once, at the end of the context
    head_wise: bool = False
    side_pages: int = 0


@dataclass(slots=True)
class LayerPlan:
    """Page needs of one layer in the coming step (never mutated: the helpers return copies).

    Attributes:
        capacity: slots the layer's block table must cover.
        compress_to: slots kept after the step's compaction, or ``None``.
        fresh_compact: the compaction writes into ``ceil(compress_to / block_size)`` fresh pages.
        keep_uncompressed: the new K/V are also written uncompressed into the block table.
        decode_compaction: a decode step's compaction (``LayerStep.decode_compaction``).
        to_heads: the compaction goes into head-wise pages (``LayerStep.to_heads``).
        compact_slack: pages a compaction into head-wise pages takes beyond
            ``ceil(compress_to / block_size)`` (``head_pages.compact_slack``); 0 for flat.
        head_growth: a head-wise layer: pages each KV head adds (its table is extended head
            by head, ``capacity`` is unused); ``None`` for other layers.
    """

    capacity: int
    compress_to: int | None = None
    fresh_compact: bool = False
    keep_uncompressed: bool = False
    decode_compaction: bool = False
    to_heads: bool = False
    compact_slack: int = 0
    head_growth: tuple[int, ...] | None = None

    def copy_on_write(self, num_held: int) -> LayerPlan:
        """Compact into fresh pages; the table keeps its held slots untouched (a decode step
        still writes its new token there: that slot is never on a shared page, which only
        ever holds full pages of cached tokens)."""
        capacity = self.capacity if self.decode_compaction else num_held
        return replace(self, capacity=capacity, fresh_compact=True)

    def keeping_uncompressed(self, total: int) -> LayerPlan:
        """Write the uncompressed K/V into the table and compact into fresh pages."""
        return replace(self, capacity=total, fresh_compact=True, keep_uncompressed=True)

    def step(self, state: LayerKV, num_new: int) -> LayerStep:
        """The runner's view of this plan, once the layer's pages are allocated."""
        heads = state.head_lens is not None
        return LayerStep(
            state.block_table,
            state.first_slot,
            state.num_held,
            num_new,
            self.compress_to,
            state.compact_table,
            self.keep_uncompressed,
            self.decode_compaction,
            self.to_heads,
            tuple(state.head_lens) if heads else None,
            tuple(state.head_pages) if heads else None,
        )


@dataclass(slots=True)
class StepPlan:
    """The check half of one request's step (``KVCacheManager.plan_step``), handed to the act
    half (``allocate``) so a step is planned once.

    Attributes:
        layers: one plan per layer (before the act half's optional widening).
        num_pages: pages the plans add, per page kind.
        layer_pages: pages each layer's plan adds (``pages_needed``).
    """

    layers: list[LayerPlan]
    num_pages: list[int]
    layer_pages: list[int]


def plan_layers(
    layers: list[LayerKV],
    policy: KVPolicy,
    num_new: int,
    completes_prompt: bool,
    in_prefill: bool,
    block_size: int,
    is_shared: Callable[[list[int]], bool],
    num_kv_heads: int = 1,
) -> list[LayerPlan]:
    """Capacity and compaction target of each layer (the budget rules of
    docs/design.md).

    Compaction happens at the last prompt chunk (every chunk in bounded mode) when the layer
    holds more than its budget, and during decode at ``budget + block_size`` slots. A
    compacting layer whose table shares a page (``is_shared(block_table)``: with another
    request or the prefix cache) compacts into fresh pages (copy-on-write). With
    ``policy.head_wise`` and several KV heads, a prefill compaction goes into head-wise pages
    (``compact_slack`` more pages), and a head-wise layer grows head by head.
    """
    to_heads = policy.head_wise and num_kv_heads > 1
    slack = head_pages.compact_slack(num_kv_heads) if to_heads else 0
    slots_per_page = num_kv_heads * block_size
    may_compact = (
        (completes_prompt or policy.bounded_chunks) if in_prefill else policy.decode_eviction
    )
    plans = []
    # Layers that only grow share one plan per capacity (plans are never mutated): most
    # layers of a request hold the same slot count, and a decode step plans 30 of them.
    plain: dict[int, LayerPlan] = {}
    for state in layers:
        if state.head_lens is not None:
            growth = head_pages.growth(state, num_new, slots_per_page)
            plans.append(LayerPlan(0, head_growth=growth))
            continue
        num_held = state.num_held
        total = num_held + num_new
        budget = state.budget
        plan = None
        if budget is not None and total > budget and may_compact:
            if in_prefill:
                # Compressed K/V are gathered before being written back, so the layer only
                # needs room for the larger of what it holds now and what it keeps.
                capacity = max(num_held, budget + slack * block_size)
                plan = LayerPlan(capacity, budget, to_heads=to_heads, compact_slack=slack)
            elif total >= budget + block_size:
                # Decode-time eviction: the new token is written in place and attended on the
                # decode path, so the table covers held + 1 = budget + block_size slots, the
                # peak.
                plan = LayerPlan(total, budget, decode_compaction=True)
        if plan is None:
            plan = plain.get(total)
            if plan is None:
                plan = plain[total] = LayerPlan(total)
        elif is_shared(state.block_table):
            plan = plan.copy_on_write(num_held)
        plans.append(plan)
    return plans


def pages_needed(plans: list[LayerPlan], layers: list[LayerKV], block_size: int) -> list[int]:
    """Pages each layer's plan adds to what its table holds: the pages its capacity lacks,
    plus ``ceil(compress_to / block_size) + compact_slack`` fresh ones when it compacts into
    fresh pages (a head-wise layer: the sum of its heads' growth)."""
    return [
        sum(plan.head_growth)
        if plan.head_growth is not None
        else max(0, cdiv(plan.capacity, block_size) - len(state.block_table))
        + (cdiv(plan.compress_to, block_size) + plan.compact_slack if plan.fresh_compact else 0)
        for plan, state in zip(plans, layers)
    ]
