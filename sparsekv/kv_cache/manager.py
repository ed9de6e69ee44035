"""The KV manager: the facade the scheduler talks to (check/act pairs over the page pool).

It owns the page storage tensor and the ``BlockPool``, and keeps one ``RequestKV`` per live
request. For every step it plans, per layer, how many slots are held, how many new tokens are
written and whether the layer compresses (CONTRACTS.md §1-§2), allocates exactly the pages
that plan needs, and after the step trims what compression or a sliding window released.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.budget import peak_layer_slots, peak_sliding_slots
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV
from sparsekv.kv_cache.spec import LayerSpec, cdiv


@dataclass
class LayerStep:
    """What one layer of one request does in a step (part of ``SchedulerOutput``).

    Attributes:
        block_table: page ids after this step's allocation.
        first_slot: logical slot of ``block_table[0]``.
        num_held: slots held before the step (``num_slots - first_slot``).
        num_new: new tokens whose K/V this layer receives.
        compress_to: if set, after attention the layer keeps exactly this many slots, chosen by
            the request's compressor over held + new slots.
    """

    block_table: list[int]
    first_slot: int
    num_held: int
    num_new: int
    compress_to: int | None = None

    @property
    def num_held_after(self) -> int:
        total = self.num_held + self.num_new
        return total if self.compress_to is None else min(self.compress_to, total)


@dataclass
class KVPolicy:
    """How a request's budgeted layers behave (resolved from its compression config)."""

    decode_eviction: bool = True
    bounded_chunks: bool = False


class KVCacheManager:
    """Allocate, plan, compact, swap and free the paged KV cache of every request.

    Args:
        layer_specs: one spec per model layer.
        num_pages: pages in the pool.
        block_size: slots per page.
        num_kv_heads, head_dim: per-layer KV shape (same for all layers).
        dtype: page storage dtype.
        device: where pages live.
        max_num_batched_tokens: step token budget (bounds a sliding layer's transient growth).
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
    ) -> None:
        self.layer_specs = layer_specs
        self.block_size = block_size
        self.pool = BlockPool(num_pages)
        self.kv_pool = torch.zeros(
            (num_pages, 2, num_kv_heads, block_size, head_dim), dtype=dtype, device=device
        )
        self.max_num_batched_tokens = max_num_batched_tokens
        self._requests: dict[str, RequestKV] = {}
        self._policies: dict[str, KVPolicy] = {}

    # ----------------------------------------------------------------- registration
    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    @property
    def num_total_pages(self) -> int:
        return self.pool.num_pages

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
    ) -> int:
        """Peak pages a request can hold (CONTRACTS.md §2), for the never-fits check."""
        total = 0
        for spec, budget in zip(self.layer_specs, budgets):
            total += cdiv(
                self._peak_layer_slots(spec, budget, num_prompt_tokens, max_tokens, policy),
                self.block_size,
            )
        return total

    def _peak_layer_slots(
        self, spec: LayerSpec, budget: int | None, n_prompt: int, max_tokens: int, p: KVPolicy
    ) -> int:
        if spec.is_sliding:
            bound = peak_sliding_slots(
                spec.sliding_window, self.max_num_batched_tokens, self.block_size
            )
            return min(n_prompt + max_tokens, bound)
        peak = peak_layer_slots(budget, n_prompt, max_tokens, self.block_size, p.decode_eviction)
        # An exact-mode chunked prefill holds the uncompressed earlier chunks until the last
        # one; a single-shot prefill never writes them (DESIGN.md §4).
        if budget is not None and n_prompt > self.max_num_batched_tokens and not p.bounded_chunks:
            peak = max(peak, n_prompt)
        return peak

    # ----------------------------------------------------------------- step planning
    def plan_layer(
        self, request_id: str, layer: int, num_new: int, completes_prompt: bool, in_prefill: bool
    ) -> tuple[int, int | None]:
        """Return ``(capacity_slots, compress_to)`` for one layer in the coming step."""
        kv = self._requests[request_id].layers[layer]
        policy = self._policies[request_id]
        total = kv.num_held + num_new
        budget = kv.budget
        compress_to = None
        if budget is not None and total > budget:
            if in_prefill:
                if completes_prompt or policy.bounded_chunks:
                    compress_to = budget
            elif policy.decode_eviction and total >= budget + self.block_size:
                compress_to = budget
        if compress_to is None:
            return total, None
        # Compressed K/V are gathered before being written back, so the layer only needs
        # room for the larger of what it holds now and what it keeps.
        return max(kv.num_held, compress_to), compress_to

    def num_pages_needed(
        self, request_id: str, num_new: int, completes_prompt: bool, in_prefill: bool
    ) -> int:
        """Pages the step would add for this request (check half of ``allocate``)."""
        kv = self._requests[request_id]
        needed = 0
        for layer, state in enumerate(kv.layers):
            capacity, _ = self.plan_layer(request_id, layer, num_new, completes_prompt, in_prefill)
            needed += max(0, cdiv(capacity, self.block_size) - len(state.block_table))
        return needed

    def can_allocate(
        self,
        request_id: str,
        num_new: int,
        completes_prompt: bool,
        in_prefill: bool,
        watermark: int = 0,
    ) -> bool:
        needed = self.num_pages_needed(request_id, num_new, completes_prompt, in_prefill)
        return needed + watermark <= self.pool.num_free_pages

    def allocate(
        self, request_id: str, num_new: int, completes_prompt: bool, in_prefill: bool
    ) -> list[LayerStep]:
        """Allocate this step's pages and return the per-layer plan (act half).

        Raises:
            RuntimeError: the pool lacks pages (the scheduler checks ``can_allocate`` first).
        """
        kv = self._requests[request_id]
        steps = []
        for layer, state in enumerate(kv.layers):
            capacity, compress_to = self.plan_layer(
                request_id, layer, num_new, completes_prompt, in_prefill
            )
            extra = cdiv(capacity, self.block_size) - len(state.block_table)
            if extra > 0:
                state.block_table.extend(self.pool.allocate(extra))
            steps.append(
                LayerStep(
                    block_table=state.block_table,
                    first_slot=state.first_slot,
                    num_held=state.num_held,
                    num_new=num_new,
                    compress_to=compress_to,
                )
            )
        return steps

    def commit(self, request_id: str, steps: list[LayerStep]) -> None:
        """Apply a finished step: new slot counts, evictions, and pages to release."""
        kv = self._requests[request_id]
        for spec, state, step in zip(self.layer_specs, kv.layers, steps):
            total = step.num_held + step.num_new
            held = step.num_held_after
            state.num_evicted += total - held
            state.num_slots = state.first_slot + held
            if spec.is_sliding:
                self._release_outside_window(state, spec.sliding_window)
            keep = cdiv(state.num_held, self.block_size)
            if len(state.block_table) > keep:
                self.pool.free(state.block_table[keep:])
                del state.block_table[keep:]

    def _release_outside_window(self, state: LayerKV, window: int) -> None:
        # The next query sits at logical slot num_slots and sees slots > num_slots - window.
        first_needed = max(0, state.num_slots - window + 1)
        num_free = (first_needed - state.first_slot) // self.block_size
        if num_free > 0:
            self.pool.free(state.block_table[:num_free])
            del state.block_table[:num_free]
            state.first_slot += num_free * self.block_size

    # ----------------------------------------------------------------- free / swap
    def free(self, request_id: str) -> None:
        """Return every page of the request to the pool and forget its state."""
        kv = self._requests.pop(request_id, None)
        self._policies.pop(request_id, None)
        if kv is None:
            return
        for state in kv.layers:
            self.pool.free(state.block_table)
            state.block_table = []

    def reset(self, request_id: str) -> None:
        """Drop all cached K/V but keep the registration (recompute preemption)."""
        kv = self._requests[request_id]
        for state in kv.layers:
            self.pool.free(state.block_table)
            state.block_table = []
            state.num_slots = state.first_slot = state.num_evicted = 0
            state.recent_queries = state.accumulated = None

    def swap_out(self, request_id: str) -> None:
        """Copy the request's pages to host memory and free them (bit-exact round trip)."""
        kv = self._requests[request_id]
        copies = []
        for state in kv.layers:
            index = torch.tensor(state.block_table, dtype=torch.long, device=self.kv_pool.device)
            copies.append(self.kv_pool.index_select(0, index).to("cpu", copy=True))
            self.pool.free(state.block_table)
            state.block_table = []
        kv.swapped_pages = copies

    def num_swap_in_pages(self, request_id: str) -> int:
        kv = self._requests[request_id]
        return sum(copy.shape[0] for copy in kv.swapped_pages or [])

    def swap_in(self, request_id: str) -> None:
        """Restore a swapped request's pages into freshly allocated pages."""
        kv = self._requests[request_id]
        for state, copy in zip(kv.layers, kv.swapped_pages):
            pages = self.pool.allocate(copy.shape[0])
            state.block_table = pages
            if pages:
                index = torch.tensor(pages, dtype=torch.long, device=self.kv_pool.device)
                self.kv_pool.index_copy_(0, index, copy.to(self.kv_pool.device))
        kv.swapped_pages = None
