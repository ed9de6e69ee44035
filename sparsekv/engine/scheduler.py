"""Continuous batching: decide how many tokens each request computes in the next step.

Every step closes the gap between each request's ``num_computed_tokens`` and ``num_tokens``
under a step token budget: decodes and prefill chunks share one batch. Running requests go
first, oldest first; when the pool runs out of pages the newest running request is preempted
(swapped, or recomputed for full-cache requests when configured). Waiting
requests are admitted only when nothing was preempted and their next step fits with a watermark.
A request admitted with nothing computed first takes its longest cached prefix (the prefix
cache's pages count as free until attached, so they are evicted before anyone is preempted).
"""

from __future__ import annotations

import time
from collections import deque

from sparsekv.config import SchedulerConfig
from sparsekv.engine.request import Request, RequestStatus
from sparsekv.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from sparsekv.kv_cache.manager import KVCacheManager, StepPlan
from sparsekv.spec_decode import drafting

MAX_PREEMPTIONS_IN_A_ROW = 3


class Scheduler:
    """Queues of waiting and running requests over one KV manager.

    Args:
        config: batching limits and preemption mode.
        kv: the KV manager (requests are registered with it before ``add``).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        # False where the runner cannot verify drafts (tensor-parallel ranks replay plain
        # steps only): every request then decodes one token per step.
        self.drafts_allowed = True

    # ----------------------------------------------------------------- queues
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished, leave the queues, and return every page to the pool."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        self.kv.free(request.request_id)

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        """Build the next step (mutates queues and KV allocations)."""
        out = SchedulerOutput()
        token_budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = request.next_chunk(token_budget)
            if num_new <= 0:
                index += 1
                continue
            drafts, plan = self._draft(request, token_budget, out)
            if drafts:
                num_new += len(drafts)
            else:
                plan = self._make_room(request, num_new, scheduled, out)
            if plan is None:
                if request.status != RequestStatus.RUNNING:
                    continue  # it preempted itself; ``running`` shifted under ``index``
                index += 1
                continue
            out.scheduled.append(self._allocate(request, num_new, plan, drafts))
            scheduled.add(request.request_id)
            token_budget -= num_new
            index += 1
        if not out.preempted_ids:
            self._admit_waiting(out, token_budget)
        return out

    def _step_flags(self, request: Request, num_new: int) -> tuple[bool, bool]:
        in_prefill = request.num_computed_tokens < request.num_prompt_tokens
        # "Completes the prompt" for compression: the end of the shared context with scope
        # "context" (``Request.compression_end``).
        completes_prompt = request.num_computed_tokens + num_new == request.compression_end
        return completes_prompt, in_prefill

    def _allocate(
        self, request: Request, num_new: int, plan: StepPlan, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        drafts = drafts or []
        completes_prompt, in_prefill = self._step_flags(request, num_new)
        layers = self.kv.allocate(request.request_id, num_new, completes_prompt, in_prefill, plan)
        samples = request.num_computed_tokens + num_new - len(drafts) == request.num_tokens
        return ScheduledRequest(request, num_new, layers, samples, drafts)

    def _draft(
        self, request: Request, token_budget: int, out: SchedulerOutput
    ) -> tuple[list[int], StepPlan | None]:
        """Draft tokens for a decoding request and the plan of its verification step, or
        ``([], None)``: drafts are dropped when the step would compact a layer (a compaction
        must never see tokens that may be rejected) or needs pages the pool lacks (nobody is
        preempted for a speculation)."""
        if request.speculative is None or not self.drafts_allowed:
            return [], None
        start = time.perf_counter()
        drafts = drafting.propose(request, token_budget)
        out.draft_seconds += time.perf_counter() - start
        if not drafts:
            return [], None
        num_new = 1 + len(drafts)
        plan = self.kv.plan_step(request.request_id, num_new, *self._step_flags(request, num_new))
        if any(layer.compress_to is not None for layer in plan.layers):
            return [], None
        # Room for one page per layer of every running request: a draft never takes the
        # page another request's step needs.
        if not self.kv.fits(plan.num_pages, self.kv.num_layers * len(self.running)):
            return [], None
        return drafts, plan

    def _make_room(
        self, request: Request, num_new: int, scheduled: set[str], out: SchedulerOutput
    ) -> StepPlan | None:
        """Preempt newest requests until ``request``'s step fits; its plan, or None if it
        cannot run now."""
        flags = self._step_flags(request, num_new)
        plan = self.kv.plan_step(request.request_id, num_new, *flags)
        while not self.kv.fits(plan.num_pages):
            victim = self._pick_victim(scheduled)
            if victim is None:
                return None
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return None
            plan = self.kv.plan_step(request.request_id, num_new, *flags)
        return plan

    def _pick_victim(self, scheduled: set[str]) -> Request | None:
        for candidate in reversed(self.running):
            if candidate.request_id in scheduled:
                continue
            is_oldest = candidate is self.running[0]
            if is_oldest and candidate.num_preemptions >= MAX_PREEMPTIONS_IN_A_ROW:
                continue
            return candidate
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.config.preemption_mode == "recompute" and not self._needs_swap(request):
            self.kv.reset(request.request_id)
            request.num_computed_tokens = 0
        else:
            self.kv.swap_out(request.request_id)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _needs_swap(self, request: Request) -> bool:
        """History-dependent caches (any budgeted layer) only resume exactly by swapping."""
        return any(layer.budget is not None for layer in self.kv.get(request.request_id).layers)

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int) -> None:
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if _awaits_leader(request):
                return
            # An idle engine admits without the watermark, so a lone request always runs.
            watermark = self.config.watermark_pages if self.running else 0
            swapped_in = False
            if self.kv.get(request.request_id).is_swapped:
                if not self.kv.can_swap_in(request.request_id, watermark):
                    return
                self.kv.swap_in(request.request_id)
                swapped_in, watermark = True, 0
            num_hit = None if swapped_in else self._attach_prefix(request)
            num_new, plan = self._fits(request, token_budget, watermark)
            if plan is None and num_hit:
                # A hit whose compaction must copy shared pages may not fit where a cold
                # start does.
                self._detach_prefix(request)
                num_hit = 0
                num_new, plan = self._fits(request, token_budget, watermark)
            if plan is None and not swapped_in:
                if num_hit:
                    self._detach_prefix(request)
                return
            self.waiting.popleft()
            request.prefill_leader = None
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if num_hit is not None:
                out.prefix_hits.append(num_hit)
                if request.num_cached_tokens is None:  # the first admission's hit is reported
                    request.num_cached_tokens = num_hit
            if plan is not None:
                out.scheduled.append(self._allocate(request, num_new, plan))
                token_budget -= num_new

    def _fits(
        self, request: Request, token_budget: int, watermark: int
    ) -> tuple[int, StepPlan | None]:
        """The next chunk's size and plan (``None`` when it does not fit with ``watermark``)."""
        num_new = request.next_chunk(token_budget)
        plan = self.kv.plan_step(request.request_id, num_new, *self._step_flags(request, num_new))
        return num_new, plan if self.kv.fits(plan.num_pages, watermark) else None

    def _attach_prefix(self, request: Request) -> int | None:
        """Look a request with nothing computed up in the prefix cache and attach the hit.

        Returns:
            Tokens hit, or ``None`` when no lookup happens (cache off, or K/V already held).
        """
        kv = self.kv.get(request.request_id)
        if self.kv.prefix_cache is None or request.num_computed_tokens or kv.is_swapped:
            return None
        if request.context_len is not None:
            # Scope "context": share the compressed context; on a miss, the uncompressed
            # prefix of the context short of its observation window (whose queries score it).
            num_hit = 0
            if request.context_key is not None:
                num_hit = self.kv.attach_context(request.request_id, request.context_key)
            if not num_hit:
                limit = request.context_len - request.compression.window
                limit = min(limit, request.max_prefix_hit_tokens(may_compact=True))
                num_hit = self.kv.attach_prefix(request.request_id, request.prompt_token_ids, limit)
            request.num_computed_tokens = num_hit
            return num_hit
        limit = request.max_prefix_hit_tokens(self._may_compact(request))
        request.num_computed_tokens = self.kv.attach_prefix(
            request.request_id, request.prompt_token_ids, limit
        )
        return request.num_computed_tokens

    def _may_compact(self, request: Request) -> bool:
        max_tokens = request.sampling_params.max_tokens
        return self.kv.may_compact(request.request_id, request.num_prompt_tokens, max_tokens)

    def shares_prompt(self, leader: Request) -> bool:
        """Whether the other samples of ``leader``'s ``n > 1`` request can take its prompt
        from the prefix cache once computed (then they wait for it: ``_awaits_leader``): a
        shared compressed context, or prompt pages that enter the cache (full cache, never
        compacted, or the uncompressed prefix cache) and give a hit of at least one page
        (none with prompt logprobs: every row must run)."""
        if self.kv.prefix_cache is None:
            return False
        if leader.context_key is not None:
            return True
        may_compact = self._may_compact(leader)
        if may_compact and not self.kv.prefix_cache_uncompressed:
            return False  # its compressed pages never enter the prefix cache
        return leader.max_prefix_hit_tokens(may_compact) >= self.kv.block_size

    def _detach_prefix(self, request: Request) -> None:
        self.kv.reset(request.request_id)
        request.num_computed_tokens = 0

    # ----------------------------------------------------------------- after a step
    def update(self, out: SchedulerOutput) -> None:
        """Commit a finished step: counters and page trimming (tokens are appended by the engine)."""
        for item in out.scheduled:
            request = item.request
            before = request.num_computed_tokens
            after = before + item.num_new_tokens
            # The step that completes the prompt offers its full pages to the prefix cache.
            completes = before < request.num_prompt_tokens <= after
            cache_ids = request.prompt_token_ids if completes else None
            self.kv.commit(request.request_id, item.layers, cache_ids)
            if request.context_key is not None and before < request.context_len <= after:
                self.kv.publish_context(
                    request.request_id, request.context_key, request.context_len
                )
            request.num_computed_tokens = after
            request.num_preemptions = 0

    def fail(self, out: SchedulerOutput) -> list[Request]:
        """A step raised: finish its requests with ``error`` and free their pages."""
        failed = []
        for item in out.scheduled:
            self.finish(item.request, "error")
            failed.append(item.request)
        return failed


def _awaits_leader(request: Request) -> bool:
    """A sample of an ``n > 1`` request waits while its first sample prefills the shared
    prompt, then attaches those pages from the prefix cache: one prefill serves all ``n``
    samples (queued requests behind it wait a step or a few, as behind any long prefill)."""
    leader = request.prefill_leader
    return (
        leader is not None
        and leader.status == RequestStatus.RUNNING
        and leader.num_computed_tokens < leader.num_prompt_tokens
    )
