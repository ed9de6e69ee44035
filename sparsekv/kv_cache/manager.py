"""The KV manager: the facade the scheduler talks to (check/act pairs over the page pool).

It owns the page storage (``kv_cache.storage``: one ``KVStorage`` per page kind, full
precision or quantized) and the ``BlockPool`` (both through ``KVPageStore``), and keeps one
``RequestKV`` per live request. For every step it plans, per layer, how many slots are held, how
many new tokens are written and whether the layer compresses (docs/design.md, "KV memory"),
allocates exactly the pages that plan needs (``step_allocation``), and after the step trims what
compression or a sliding window released (``commit``). Prefix and context sharing, freeing and
swapping run through ``prefix_sharing``, ``context_sharing`` and ``release``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.kv_cache import context_sharing as contexts
from sparsekv.kv_cache import prefix_sharing as sharing
from sparsekv.kv_cache import release
from sparsekv.kv_cache import step_allocation as allocation
from sparsekv.kv_cache.budget import may_compact
from sparsekv.kv_cache.commit import commit_layers
from sparsekv.kv_cache.page_store import KVPageStore
from sparsekv.kv_cache.plan import KVPolicy, LayerStep, StepPlan, pages_needed, plan_layers
from sparsekv.kv_cache.prefix_cache import PrefixCache
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV
from sparsekv.kv_cache.spec import LayerSpec

__all__ = ["KVCacheManager", "KVPolicy", "LayerStep", "StepPlan"]


class KVCacheManager(KVPageStore):
    """Allocate, plan, compact, swap and free the paged KV cache of every request.

    Every argument but the three below is ``KVPageStore``'s (the page pool: ``layer_specs``,
    ``num_pages``, ``block_size``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``device``,
    ``max_num_batched_tokens``, ``kv_cache_dtype``, ``full_precision_layers``, ``backend``),
    passed on to it and documented there.

    Args:
        enable_prefix_caching: share full pages of identical prefixes through a
            ``PrefixCache`` (the caller keeps it off for models with sliding-window layers).
        prefix_cache_uncompressed: at a compressing prefill, also keep the budgeted layers'
            uncompressed prompt pages in the prefix cache while the pool has room.
        num_heads: the model's query heads (sizes the side state; ``None``: ``num_kv_heads``).

    Raises:
        ValueError: a page-pool argument ``KVPageStore`` refuses (see there).
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
        super().__init__(
            layer_specs,
            num_pages,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            max_num_batched_tokens,
            kv_cache_dtype,
            full_precision_layers,
            backend,
        )
        self.num_heads = num_heads if num_heads is not None else num_kv_heads
        # Per layer, the sliding window whose leading pages ``commit`` frees, else None.
        self._windows = [spec.sliding_window if spec.is_sliding else None for spec in layer_specs]
        self._requests: dict[str, RequestKV] = {}
        self._policies: dict[str, KVPolicy] = {}
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        self.prefix_cache_uncompressed = prefix_cache_uncompressed

    # ----------------------------------------------------------------- registration
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
        num_pages[self.side_kind] += allocation.side_pages_due(kv, policy)
        return StepPlan(plans, num_pages, layer_pages)

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
        kv, policy = self._requests[request_id], self._policies[request_id]
        if plan is None:
            plan = self.plan_step(request_id, num_new, completes_prompt, in_prefill)
        allocation.take_side_pages(self.pool, kv, policy, self.side_kind)
        widen = self.prefix_cache is not None and self.prefix_cache_uncompressed
        if in_prefill and widen and completes_prompt:
            # A reserve of one page per layer and live request.
            reserve = self.num_layers * len(self._requests)
            step = (num_new, self.block_size, self._by_kind, self.fits, reserve)
            plan = allocation.keeping_uncompressed(self.pool, kv, policy, plan, *step)
        allocation.allocate_layers(self.pool, self.layer_kinds, kv.layers, plan, self.block_size)
        return [layer.step(state, num_new) for layer, state in zip(plan.layers, kv.layers)]

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
        release.release_tables(self.pool, self.prefix_cache, tables)

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
    def free(self, request_id: str) -> None:
        """Return every page of the request to the pool and forget its state."""
        kv = self._requests.pop(request_id, None)
        self._policies.pop(request_id, None)
        if kv is not None:
            release.drop_tables(self._release, kv)
            release.drop_side_pages(self.pool, kv)

    def reset(self, request_id: str) -> None:
        """Drop all cached K/V but keep the registration (recompute preemption, or undoing
        ``attach_prefix``)."""
        kv = self._requests[request_id]
        release.drop_tables(self._release, kv)
        release.drop_side_pages(self.pool, kv)
        release.clear_layers(kv)

    def swap_out(self, request_id: str) -> None:
        """Copy the request's pages to host memory and drop its references (bit-exact round
        trip, codes and scales; shared pages are copied like any other and stay with their
        other holders; int4 residuals stay in the layer state)."""
        release.swap_out(self.pool, self._release, self._requests[request_id], self.storage)

    def _swap_in_needed(self, request_id: str) -> list[int]:
        kv = self._requests[request_id]
        needed = self._by_kind(release.swapped_layer_pages(kv))
        needed[self.side_kind] += allocation.side_pages_due(kv, self._policies[request_id])
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
        allocation.take_side_pages(self.pool, kv, self._policies[request_id], self.side_kind)
        release.swap_in(self.pool, kv, self.storage, self.layer_kinds)
