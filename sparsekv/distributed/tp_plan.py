"""The step plan rank 0 broadcasts to the other tensor-parallel ranks, and its replay there.

Rank 0 runs the scheduler and the KV manager; the other ranks decide nothing. Each step rank 0
sends a ``StepBroadcast``: the requests the workers see for the first time (prompt, policy,
generator state of the ``random`` compressor), the ones rank 0 has freed, the page copies its
KV manager made since the last step (swap out / in, a shared context's partial pages), and per
scheduled request its tokens, its per-layer ``LayerStep``s and the counters of its
``LayerKV``s. A worker mirrors the requests (``MirrorState``), replays the page copies on its
own pool (same page ids, its own KV heads), and runs the same ``ModelRunner.execute``: the
forward's collectives line up because every rank runs the same batch in the same order.

The side state kept per (request, layer) outside the pool (window queries, H2O mass) is the
rank's own heads' and stays on the rank; when rank 0 drops it (a recompute preemption) the plan
says so and the worker drops its own.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from sparsekv.config import CompressionConfig
from sparsekv.engine.request import Request
from sparsekv.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from sparsekv.kv_cache.manager import KVCacheManager, LayerStep
from sparsekv.kv_cache.policy import CompressionPolicy
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """What a worker needs of a request once: its prompt, policy and random stream."""

    request_id: str
    prompt_token_ids: list[int]
    compression: CompressionConfig | None
    prompt_logprobs: int | None
    kv_generator_state: torch.Tensor | None


@dataclass
class LayerCounters:
    """A ``LayerKV``'s counters on rank 0 before the step (and which side state it holds)."""

    block_table: list[int]
    num_slots: int
    first_slot: int
    num_evicted: int
    budget: int | None
    compact_table: list[int] | None
    has_queries: bool
    has_accumulated: bool


@dataclass
class ScheduledItem:
    """One scheduled request of the step."""

    request_id: str
    num_computed_tokens: int
    tokens: list[int]
    layers: list[LayerStep]
    counters: list[LayerCounters]
    samples: bool


@dataclass
class StepBroadcast:
    """One message from rank 0: ``kind`` ``step``, ``snapshot`` (report a request's cached
    keys) or ``stop`` (leave the loop)."""

    kind: str = "step"
    new: list[NewRequest] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    page_ops: list[tuple] = field(default_factory=list)
    items: list[ScheduledItem] = field(default_factory=list)
    snapshot_id: str | None = None


class PageOpLog:
    """Records the page copies rank 0's KV manager makes outside a step, for the workers.

    ``read_pages`` copies get a handle (dropped when rank 0 lets go of the copy);
    ``write_pages`` of such a copy is replayed from the worker's own copy of that handle.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.ops: list[tuple] = []
        self._handles: dict[int, int] = {}  # id(first tensor of a copy) -> handle
        self._next = 0
        for kind, storage in enumerate(kv.storages):
            storage.read_pages = self._reader(kind, storage.read_pages)
            storage.write_pages = self._writer(kind, storage.write_pages)

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def _reader(self, kind: int, read):
        def read_pages(pages: list[int]) -> tuple[torch.Tensor, ...]:
            copy = read(pages)
            handle, self._next = self._next, self._next + 1
            self._handles[id(copy[0])] = handle
            weakref.finalize(copy[0], self._drop, id(copy[0]), handle)
            self.ops.append(("read", kind, list(pages), handle))
            return copy

        return read_pages

    def _writer(self, kind: int, write):
        def write_pages(pages: list[int], copy: tuple[torch.Tensor, ...]) -> None:
            write(pages, copy)
            self.ops.append(("write", kind, list(pages), self._handles[id(copy[0])]))

        return write_pages

    def _drop(self, key: int, handle: int) -> None:
        if self._handles.get(key) == handle:
            del self._handles[key]
        self.ops.append(("drop", handle))


def layer_counters(state: LayerKV) -> LayerCounters:
    """Rank 0's counters of one layer (without merging its logged decode queries)."""
    owner = state._owner
    has_queries = state._queries is not None or bool(owner is not None and owner._query_log)
    return LayerCounters(
        block_table=list(state.block_table),
        num_slots=state.num_slots,
        first_slot=state.first_slot,
        num_evicted=state.num_evicted,
        budget=state.budget,
        compact_table=None if state.compact_table is None else list(state.compact_table),
        has_queries=has_queries,
        has_accumulated=state.accumulated is not None,
    )


def build_step(out: SchedulerOutput, kv: KVCacheManager, known: dict, ops) -> StepBroadcast:
    """The broadcast of a scheduled step.

    Args:
        out: the scheduled step.
        kv: rank 0's KV manager.
        known: request id -> rank 0's ``RequestKV`` of each request the workers mirror
            (updated: a request id reused by a new request is dropped and sent again).
        ops: the page copies since the last message (``PageOpLog.take``).
    """
    plan = StepBroadcast(page_ops=ops)
    plan.dropped = [
        rid for rid, state in known.items() if not kv.has(rid) or kv.get(rid) is not state
    ]
    for rid in plan.dropped:
        del known[rid]
    for item in out.scheduled:
        request = item.request
        rid = request.request_id
        if rid not in known:
            known[rid] = kv.get(rid)
            generator = request.kv_generator
            plan.new.append(
                NewRequest(
                    rid,
                    list(request.prompt_token_ids),
                    request.compression,
                    request.sampling_params.prompt_logprobs,
                    None if generator is None else generator.get_state(),
                )
            )
        first = request.num_computed_tokens
        plan.items.append(
            ScheduledItem(
                rid,
                first,
                list(request.token_slice(first, first + item.num_new_tokens)),
                item.layers,
                [layer_counters(state) for state in kv.get(rid).layers],
                item.samples,
            )
        )
    return plan


class MirrorRequest(Request):
    """A worker's copy of a request: the step's tokens come from the plan."""

    step_tokens: list[int] = []

    def token_slice(self, start: int, end: int) -> list[int]:
        assert end - start == len(self.step_tokens), (start, end, len(self.step_tokens))
        return self.step_tokens


class MirrorState:
    """The requests a worker mirrors, in its own KV manager (same ids, its own heads)."""

    def __init__(self, kv: KVCacheManager, make_compressor) -> None:
        self.kv = kv
        self.make_compressor = make_compressor
        self.requests: dict[str, MirrorRequest] = {}
        self.copies: dict[int, tuple[torch.Tensor, ...]] = {}

    def apply(self, plan: StepBroadcast) -> SchedulerOutput:
        """Replay the plan's bookkeeping; the ``SchedulerOutput`` to execute."""
        for rid in plan.dropped:
            self.requests.pop(rid, None)
            self.kv._requests.pop(rid, None)
        for op in plan.page_ops:
            self._page_op(op)
        for new in plan.new:
            self._register(new)
        out = SchedulerOutput()
        for item in plan.items:
            request = self.requests[item.request_id]
            request.num_computed_tokens = item.num_computed_tokens
            request.step_tokens = item.tokens
            for state, counters in zip(self.kv.get(item.request_id).layers, item.counters):
                _set_counters(state, counters)
            out.scheduled.append(
                ScheduledRequest(request, len(item.tokens), item.layers, item.samples)
            )
        return out

    def _register(self, new: NewRequest) -> None:
        generator = None
        if new.kv_generator_state is not None:
            generator = torch.Generator()
            generator.set_state(new.kv_generator_state)
        settings = new.compression
        params = SamplingParams(temperature=0.0, prompt_logprobs=new.prompt_logprobs)
        # The mirror's policy: settings and this rank's compressor (budgets come with each
        # step's layer counters).
        policy = CompressionPolicy(settings, self.make_compressor(settings))
        self.requests[new.request_id] = MirrorRequest(
            request_id=new.request_id,
            prompt_token_ids=new.prompt_token_ids,
            sampling_params=params,
            policy=policy,
            kv_generator=generator,
        )
        self.kv._requests[new.request_id] = _empty_request_kv(self.kv.num_layers)

    def _page_op(self, op: tuple) -> None:
        if op[0] == "drop":
            self.copies.pop(op[1], None)
            return
        kind, pages, handle = op[1:]
        storage = self.kv.storages[kind]
        if op[0] == "read":
            self.copies[handle] = storage.read_pages(pages)
        else:
            storage.write_pages(pages, self.copies[handle])


def _empty_request_kv(num_layers: int):
    from sparsekv.kv_cache.request_kv import RequestKV

    return RequestKV(layers=[LayerKV() for _ in range(num_layers)])


def _set_counters(state: LayerKV, counters: LayerCounters) -> None:
    state.block_table = list(counters.block_table)
    state.num_slots, state.first_slot = counters.num_slots, counters.first_slot
    state.num_evicted, state.budget = counters.num_evicted, counters.budget
    state.compact_table = counters.compact_table
    if not counters.has_queries:
        state.recent_queries = None
    if not counters.has_accumulated:
        state.accumulated = None
