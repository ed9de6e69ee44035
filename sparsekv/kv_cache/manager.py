"""The KV manager: the facade the scheduler talks to (check/act pairs over the page pool).

It owns the page storage (``kv_cache.storage``: one ``KVStorage`` per page kind, full
precision or quantized) and the ``BlockPool``, and keeps one ``RequestKV`` per live request. For every step it plans, per layer, how many slots are held, how many new tokens are
written and whether the layer compresses (docs/design.md, "KV memory"), allocates exactly the pages
that plan needs, and after the step trims what compression or a sliding window released.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.kv_cache import context_sharing as contexts
from sparsekv.kv_cache import head_pages
from sparsekv.kv_cache import prefix_sharing as sharing
from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.budget import may_compact, peak_request_pages
from sparsekv.kv_cache.commit import commit_layers
from sparsekv.kv_cache.plan import (
    KVPolicy,
    LayerPlan,
    LayerStep,
    StepPlan,
    pages_needed,
    plan_layers,
)
from sparsekv.kv_cache.prefix_cache import PrefixCache
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV
from sparsekv.kv_cache.spec import LayerSpec, cdiv
from sparsekv.kv_cache.storage import KVStorage, make_storage

__all__ = ["KVCacheManager", "KVPolicy", "LayerStep", "StepPlan"]


class KVCacheManager:
    """Allocate, plan, compact, swap and free the paged KV cache of every request.

    Args:
        layer_specs: one spec per model layer.
        num_pages: pages in the pool; with ``full_precision_layers``, a pair (quantized pages,
            full-precision pages).
        block_size: slots per page.
        num_kv_heads, head_dim: per-layer KV shape (same for all layers).
        dtype: the model's compute dtype (page storage dtype for ``auto``).
        device: where pages live.
        max_num_batched_tokens: step token budget (bounds a sliding layer's transient growth).
        enable_prefix_caching: share full pages of identical prefixes through a
            ``PrefixCache`` (the caller keeps it off for models with sliding-window layers).
        prefix_cache_uncompressed: at a compressing prefill, also keep the budgeted layers'
            uncompressed prompt pages in the prefix cache while the pool has room.
        kv_cache_dtype: page format, ``auto`` (= ``dtype``), ``int8``, ``fp8`` or ``int4``.
        full_precision_layers: layers whose pages stay in ``dtype`` when the format is
            quantized; they draw from a second pool (page kind 1).
        backend: the engine's attention backend every storage runs on (``None``: the
            ``auto`` backend of ``device``).
        num_heads: the model's query heads (sizes the side state; ``None``: ``num_kv_heads``).

    Raises:
        ValueError: an unknown format, a layer index out of range, or ``num_pages`` that does
            not match the number of page kinds.
    """

    def __init__(
        self,
        layer_specs: list[LayerSpec],
        num_pages: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        max_num_batched_tokens: int = 4096,
        enable_prefix_caching: bool = False,
        prefix_cache_uncompressed: bool = False,
        kv_cache_dtype: str = "auto",
        full_precision_layers: Sequence[int] = (),
        backend: AttentionBackend | None = None,
        num_heads: int | None = None,
    ) -> None:
        self.layer_specs = layer_specs
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.num_heads = num_heads if num_heads is not None else num_kv_heads
        self.head_dim = head_dim
        full = sorted(set(full_precision_layers)) if kv_cache_dtype != "auto" else []
        if any(not 0 <= layer < len(layer_specs) for layer in full):
            raise ValueError(
                f"kv_cache_full_precision_layers: {full} out of range for {len(layer_specs)} layers"
            )
        formats = [kv_cache_dtype] + (["auto"] if full else [])
        sizes = [num_pages] if isinstance(num_pages, int) else list(num_pages)
        if len(sizes) != len(formats):
            raise ValueError(f"num_pages: {len(formats)} page kinds need {len(formats)} sizes")
        self.pool = BlockPool(sizes)
        self.storages: list[KVStorage] = [
            make_storage(
                fmt, size, start, num_kv_heads, block_size, head_dim, dtype, device, backend
            )
            for fmt, size, start in zip(formats, sizes, self.pool.kind_starts)
        ]
        self.layer_kinds = [int(layer in full) for layer in range(len(layer_specs))]
        # Per layer, the sliding window whose leading pages ``commit`` frees, else None.
        self._windows = [spec.sliding_window if spec.is_sliding else None for spec in layer_specs]
        self.kv_cache_dtype = kv_cache_dtype
        self.max_num_batched_tokens = max_num_batched_tokens
        self._requests: dict[str, RequestKV] = {}
        self._policies: dict[str, KVPolicy] = {}
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        self.prefix_cache_uncompressed = prefix_cache_uncompressed
        self._scratch: list[int] | None = None

    # ----------------------------------------------------------------- registration
    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get: free ones plus cached pages nobody holds (evictable)."""
        return self.pool.num_free_pages + self.pool.num_reclaimable_pages

    @property
    def num_total_pages(self) -> int:
        """Pages requests can hold: the pool less its scratch pages."""
        return self.pool.num_pages - len(self._scratch or ())

    def storage(self, layer: int) -> KVStorage:
        """The page storage a layer's block table indexes."""
        return self.storages[self.layer_kinds[layer]]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the main kind (codes and scales)."""
        return self.storages[0].page_bytes

    def scratch_pages(self) -> list[int]:
        """One page per kind that no request ever holds, taken from the pool on the first
        call: the padding rows of a static-shape decode batch write their K/V there.

        Returns:
            Per page kind, the global id of its scratch page.
        """
        if self._scratch is None:
            self._scratch = [self.pool.allocate(1, kind)[0] for kind in range(self.pool.num_kinds)]
        return self._scratch

    def fits(self, needed: list[int], watermark: int = 0) -> bool:
        """Whether every kind has ``needed[k] + watermark`` free or reclaimable pages."""
        return all(
            need == 0 or need + watermark <= self.pool.num_available(kind)
            for kind, need in enumerate(needed)
        )

    def _by_kind(self, per_layer: Sequence[int]) -> list[int]:
        if self.pool.num_kinds == 1:
            return [sum(per_layer)]
        totals = [0] * self.pool.num_kinds
        for kind, count in zip(self.layer_kinds, per_layer):
            totals[kind] += count
        return totals

    def register(self, request_id: str, budgets: list[int | None], policy: KVPolicy) -> None:
        """Create empty per-layer state; ``budgets[l]`` is None for never-compressed layers."""
        layers = [LayerKV(budget=b) for b in budgets]
        self._requests[request_id] = RequestKV(layers=layers)
        self._policies[request_id] = policy

    def get(self, request_id: str) -> RequestKV:
        return self._requests[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    # ----------------------------------------------------------------- footprint
    def peak_pages(
        self, budgets: list[int | None], num_prompt_tokens: int, max_tokens: int, policy: KVPolicy
    ) -> list[int]:
        """Peak pages a request can hold per page kind, for the never-fits
        check against ``pool.kind_sizes``."""
        peaks = []
        for kind in range(self.pool.num_kinds):
            layers = [i for i, k in enumerate(self.layer_kinds) if k == kind]
            peaks.append(
                peak_request_pages(
                    [self.layer_specs[i] for i in layers],
                    [budgets[i] for i in layers],
                    num_prompt_tokens,
                    max_tokens,
                    self.block_size,
                    self.max_num_batched_tokens,
                    decode_eviction=policy.decode_eviction,
                    bounded_chunks=policy.bounded_chunks,
                    head_slack=self.num_kv_heads if policy.head_wise else 0,
                )
            )
        return peaks

    def may_compact(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> bool:
        """Whether any budgeted layer of the request can ever compact (``budget.may_compact``)."""
        budgets = [state.budget for state in self._requests[request_id].layers]
        decode_eviction = self._policies[request_id].decode_eviction
        return may_compact(budgets, num_prompt_tokens, max_tokens, self.block_size, decode_eviction)

    # ----------------------------------------------------------------- step planning
    def plan_step(
        self, request_id: str, num_new: int, completes_prompt: bool, in_prefill: bool
    ) -> StepPlan:
        """Per-layer plans of the coming step and the pages they add (check half of
        ``allocate``; ``fits(plan.num_pages)`` tells whether the pool has them)."""
        kv, policy = self._requests[request_id], self._policies[request_id]
        step = (num_new, completes_prompt, in_prefill, self.block_size)
        plans = plan_layers(kv.layers, policy, *step, self.pool.any_shared, self.num_kv_heads)
        layer_pages = pages_needed(plans, kv.layers, self.block_size)
        num_pages = self._by_kind(layer_pages)
        num_pages[0] += self._side_pages_due(kv, policy)
        return StepPlan(plans, num_pages, layer_pages)

    @staticmethod
    def _side_pages_due(kv: RequestKV, policy: KVPolicy | None) -> int:
        """Side-state pages the request's next step takes (all of them on its first step, or
        back from a swap); ``None``: a caller registered no policy (none)."""
        return 0 if kv.side_pages or policy is None else policy.side_pages

    def _take_side_pages(self, request_id: str) -> None:
        """Take the side pages the request does not hold yet (its plan counted them)."""
        kv = self._requests[request_id]
        due = self._side_pages_due(kv, self._policies[request_id])
        if due:
            kv.side_pages = self.pool.allocate(due)

    def num_pages_needed(
        self, request_id: str, num_new: int, completes_prompt: bool, in_prefill: bool
    ) -> int:
        """Pages the step would add for this request, all kinds (check half of ``allocate``)."""
        return sum(self.plan_step(request_id, num_new, completes_prompt, in_prefill).num_pages)

    def can_allocate(
        self,
        request_id: str,
        num_new: int,
        completes_prompt: bool,
        in_prefill: bool,
        watermark: int = 0,
    ) -> bool:
        """Whether the pool has the step's pages with ``watermark`` to spare, every kind
        (``plan_step`` then ``fits``)."""
        plan = self.plan_step(request_id, num_new, completes_prompt, in_prefill)
        return self.fits(plan.num_pages, watermark)

    def _widened(
        self, request_id: str, plan: StepPlan, num_new: int, completes_prompt: bool
    ) -> StepPlan:
        """The act half's plan of a prefill step: with ``prefix_cache_uncompressed``, a
        compressing last prefill chunk also keeps its uncompressed prompt for the cache, but
        only when those extra pages leave a reserve of one page per layer and live request:
        the check half counts the plain plan, so the act half never needs more than the check
        allowed, and a short pool falls back silently.
        """
        kv = self._requests[request_id]
        policy = self._policies[request_id]
        widen = self.prefix_cache is not None and self.prefix_cache_uncompressed
        widen = widen and completes_prompt and not policy.bounded_chunks
        widen = widen and not policy.context_only
        plans = plan.layers
        if widen and sharing.may_keep_uncompressed(self.pool, kv, plans, num_new, self.block_size):
            wide = [
                p if p.compress_to is None else p.keeping_uncompressed(s.num_held + num_new)
                for p, s in zip(plans, kv.layers)
            ]
            reserve = self.num_layers * len(self._requests)
            layer_pages = pages_needed(wide, kv.layers, self.block_size)
            num_pages = self._by_kind(layer_pages)
            if self.fits(num_pages, reserve):
                return StepPlan(wide, num_pages, layer_pages)
        return plan

    def allocate(
        self,
        request_id: str,
        num_new: int,
        completes_prompt: bool,
        in_prefill: bool,
        plan: StepPlan | None = None,
    ) -> list[LayerStep]:
        """Allocate this step's pages and return the per-layer plan (act half).

        Evicts unreferenced prefix-cache groups (LRU) when the free list runs short.

        Args:
            request_id, num_new, completes_prompt, in_prefill: the step, as for ``plan_step``.
            plan: ``plan_step``'s result for these arguments with no page taken or released
                since (the scheduler's check), or ``None`` to plan here.

        Raises:
            RuntimeError: the pool lacks pages (the scheduler checks ``fits(plan.num_pages)``
                first).
        """
        kv = self._requests[request_id]
        if plan is None:
            plan = self.plan_step(request_id, num_new, completes_prompt, in_prefill)
        self._take_side_pages(request_id)
        if in_prefill:
            plan = self._widened(request_id, plan, num_new, completes_prompt)
        per_layer = zip(self.layer_kinds, kv.layers, plan.layers, plan.layer_pages)
        for kind, state, layer, num_pages in per_layer:
            if layer.head_growth is not None:
                if num_pages:
                    allocate = functools.partial(self.pool.allocate, kind=kind)
                    head_pages.grow(state, layer.head_growth, allocate)
            elif num_pages or layer.fresh_compact:  # most decode steps add no page to a layer
                self._allocate_layer(kind, state, layer)
        return [layer.step(state, num_new) for layer, state in zip(plan.layers, kv.layers)]

    def _allocate_layer(self, kind: int, state: LayerKV, layer: LayerPlan) -> None:
        """Extend a layer's table to its plan's capacity and take its fresh compaction pages."""
        extra = cdiv(layer.capacity, self.block_size) - len(state.block_table)
        if extra > 0:
            state.block_table.extend(self.pool.allocate(extra, kind))
        if layer.fresh_compact:
            num = cdiv(layer.compress_to, self.block_size) + layer.compact_slack
            state.compact_table = self.pool.allocate(num, kind)

    def commit(
        self, request_id: str, steps: list[LayerStep], cache_token_ids: Sequence[int] | None = None
    ) -> None:
        """Apply a finished step: new slot counts, evictions, and pages to release.

        Args:
            request_id: the request.
            steps: the plans the step ran with.
            cache_token_ids: when given (the step completed the prompt), these tokens' full
                pages enter the prefix cache if every layer holds them uncompressed.
        """
        kv = self._requests[request_id]
        if cache_token_ids is not None and self.prefix_cache is not None:
            sharing.offer_step(self.prefix_cache, kv.layers, steps, cache_token_ids)
        commit_layers(self.pool, self._release, self._windows, kv.layers, steps, self.block_size)

    # ----------------------------------------------------------------- prefix cache
    def attach_prefix(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> int:
        """Share the longest cached prefix (page-aligned, at most ``max_tokens`` tokens) with a
        request that holds nothing yet (``prefix_sharing.attach_hit``).

        Returns:
            Tokens hit (0 when the cache is off or misses); undo with ``reset``.
        """
        if self.prefix_cache is None or max_tokens < self.block_size:
            return 0
        layers = self._requests[request_id].layers
        return sharing.attach_hit(self.prefix_cache, self.pool, layers, token_ids, max_tokens)

    def cache_computed(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Offer a finishing request's computed tokens (full pages) to the prefix cache; nothing
        is cached unless every layer still holds every token uncompressed."""
        kv = self._requests.get(request_id)
        if self.prefix_cache is not None and kv is not None and not kv.is_swapped:
            sharing.offer_computed(self.prefix_cache, kv.layers, token_ids)

    def publish_context(self, request_id: str, key: bytes, num_tokens: int) -> bool:
        """Cache a request's just-compressed context (scope ``context``) for later requests
        with the same key: the full pages of every layer are shared, each partial last page
        and int4 residual copied out. Needs no page (nothing is allocated).

        Returns:
            Whether the context was cached (not when the key is cached, the cache is off, or
            a page already belongs to a cached prefix).
        """
        if self.prefix_cache is None:
            return False
        layers = self._requests[request_id].layers
        return contexts.publish(
            self.prefix_cache, layers, self.storage, key, num_tokens, self.block_size
        )

    def attach_context(self, request_id: str, key: bytes) -> int:
        """Give an empty request the cached compressed context of ``key``: its full pages
        (shared) and a private copy of each partial last page (one fresh page per layer).

        Returns:
            The context's length in tokens, or 0 (not cached, or no room for the copies);
            undo with ``reset``.
        """
        if self.prefix_cache is None:
            return 0
        layers = self._requests[request_id].layers

        def fits(per_layer: list[int]) -> bool:
            return self.fits(self._by_kind(per_layer))

        return contexts.attach(
            self.prefix_cache, self.pool, layers, self.storage, self.layer_kinds, fits, key
        )

    def _release(self, tables: list[list[int]]) -> None:
        """Drop a request's reference on each page of ``tables`` (cached groups: tail first)."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(tables)
        for table in tables:
            self.pool.free(table)

    def check_invariants(self) -> None:
        """Refcount of every page = block tables holding it (+1 if cached); held pages are not
        free; the free list has no duplicates; the cache's page map matches its groups.

        Raises:
            AssertionError: an invariant is broken.
        """
        holders = sharing.table_holders(self._requests.values())
        holders.update(self._scratch or [])
        for kv in self._requests.values():
            holders.update(kv.side_pages)
        self.pool.check_invariants(holders)
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()

    # ----------------------------------------------------------------- free / swap
    def _drop_tables(self, kv: RequestKV) -> None:
        tables = [state.block_table for state in kv.layers]
        tables += [state.compact_table for state in kv.layers if state.compact_table]
        self._release(tables)
        for state in kv.layers:
            state.block_table, state.compact_table = [], None

    def free(self, request_id: str) -> None:
        """Return every page of the request to the pool and forget its state."""
        kv = self._requests.pop(request_id, None)
        self._policies.pop(request_id, None)
        if kv is not None:
            self._drop_tables(kv)
            self._drop_side_pages(kv)

    def _drop_side_pages(self, kv: RequestKV) -> None:
        self.pool.free(kv.side_pages)
        kv.side_pages = []

    def reset(self, request_id: str) -> None:
        """Drop all cached K/V but keep the registration (recompute preemption, or undoing
        ``attach_prefix``)."""
        kv = self._requests[request_id]
        self._drop_tables(kv)
        self._drop_side_pages(kv)
        for state in kv.layers:
            state.num_slots = state.first_slot = state.num_evicted = 0
            state.recent_queries = state.accumulated = state.residual = None
            state.head_lens = state.head_pages = None

    def swap_out(self, request_id: str) -> None:
        """Copy the request's pages to host memory and drop its references (bit-exact round
        trip, codes and scales; shared pages are copied like any other and stay with their
        other holders; int4 residuals stay in the layer state)."""
        kv = self._requests[request_id]
        copies = [
            self.storage(layer).read_pages(state.block_table)
            for layer, state in enumerate(kv.layers)
        ]
        self._drop_tables(kv)
        # The side state goes to host memory with the K/V copies (it stays in the layer state;
        # host memory is not the pool's): a swapped request holds no page, so the request at
        # the head of the queue always fits an idle engine.
        self._drop_side_pages(kv)
        kv.swapped_pages = copies

    def _swap_in_needed(self, request_id: str) -> list[int]:
        kv = self._requests[request_id]
        needed = self._by_kind([copy[0].shape[0] for copy in kv.swapped_pages or []])
        needed[0] += self._side_pages_due(kv, self._policies[request_id])
        return needed

    def num_swap_in_pages(self, request_id: str) -> int:
        return sum(self._swap_in_needed(request_id))

    def can_swap_in(self, request_id: str, watermark: int = 0) -> bool:
        """Whether the swapped request's pages and side pages, plus one page per layer for its
        next step and ``watermark``, fit in every kind."""
        needed = self._swap_in_needed(request_id)
        for kind in self.layer_kinds:
            needed[kind] += 1
        return self.fits(needed, watermark)

    def swap_in(self, request_id: str) -> None:
        """Restore a swapped request's pages into freshly allocated (private) pages, and take
        its side pages again."""
        kv = self._requests[request_id]
        self._take_side_pages(request_id)
        for layer, (state, copy) in enumerate(zip(kv.layers, kv.swapped_pages)):
            state.block_table = self.pool.allocate(copy[0].shape[0], self.layer_kinds[layer])
            self.storage(layer).write_pages(state.block_table, copy)
        kv.swapped_pages = None
