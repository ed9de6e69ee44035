"""``AsyncEngine``: the synchronous ``LLMEngine`` driven by a background thread for asyncio users.

One loop thread owns the engine: every engine call (add, abort, step) runs there, so calls are
serialised without a lock held across a step. Coroutines talk to it through a command queue
that the thread drains between steps; its outputs come back to per-request ``asyncio.Queue``s
through ``loop.call_soon_threadsafe``. The event loop therefore never waits on a forward pass.

An exception inside a step fails only that step's requests (``LLMEngine.step`` handles it); an
exception escaping the loop itself marks the engine dead (``is_alive`` False), fails every
pending request with ``EngineDeadError`` and stops the thread; ``/health`` then answers 503.

This module holds the event-loop half (start, admission, request streams); the loop thread's
half, which ``AsyncEngine`` inherits, is ``engine.async_loop.EngineLoop``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from sparsekv.config import CompressionConfig
from sparsekv.engine.async_loop import IDLE_WAIT_S, EngineLoop
from sparsekv.engine.async_types import (
    EngineDeadError,
    EngineOverloadedError,
    EngineSnapshot,
    RequestStream,
    RequestTimeoutError,
)
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.engine.openmp_pool import release_thread_pool
from sparsekv.outputs import RequestOutput
from sparsekv.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineSnapshot",
    "RequestStream",
    "RequestTimeoutError",
    "admits_request",
]


class AsyncEngine(EngineLoop):
    """Asyncio front of an ``LLMEngine`` (its loop runs in a background thread).

    Args:
        engine: the engine to drive; no other thread may call it once ``start`` ran.
        max_waiting: most requests queued beyond the free running slots
            (``EngineOverloadedError`` past it); defaults to the engine's
            ``SchedulerConfig.max_waiting``.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        super().__init__(engine)
        self.max_waiting = max_waiting or engine.config.scheduler.max_waiting

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the loop thread; call from inside the running event loop. The calling thread
        (which loaded the model, in ``serve``) gives up its OpenMP worker pool, so that the
        loop thread's own pool keeps its full spin-wait (``openmp_pool``)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        release_thread_pool()
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="sparsekv-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """True while the loop thread runs and has not been asked to stop."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request, free their pages and stop the loop thread.

        Args:
            timeout: seconds to wait for the thread (a step in flight finishes first).
        """
        if self._thread is None or not self._thread.is_alive():
            return
        self._put(("stop",))
        await asyncio.to_thread(self._thread.join, timeout)

    def snapshot(self) -> EngineSnapshot:
        """The latest published engine state (cheap; safe from any thread)."""
        return self._snapshot

    async def refresh(self) -> None:
        """Nothing to fetch: the loop thread publishes its snapshot after every step (a client
        of remote replicas fetches theirs here, before /metrics is rendered)."""

    # ----------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compression: CompressionConfig | dict | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Add a request; returns once the engine accepted it (or raises why not).

        Args:
            request_id: unique id.
            prompt_token_ids: the tokenized prompt.
            params: sampling parameters.
            compression: per-request policy override (merged over the engine default).
            timeout: seconds from now; past it the request is aborted.

        Returns:
            The request's outputs as an async iterator; call ``abort()`` on it if you stop
            reading before it finishes.

        Raises:
            ValueError: invalid input (the message starts with the parameter's name).
            EngineOverloadedError: the waiting queue is full.
            EngineDeadError: the loop is not running.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        # Samples that free running slots take at the next step are not kept waiting: a burst
        # fills them before it counts against max_waiting. (Where pages, not slots, hold
        # admission back, up to max_num_seqs - num_running more may wait.)
        snapshot = self._snapshot
        if not admits_request(
            num_running=snapshot.num_running,
            num_waiting=snapshot.num_waiting,
            num_pending=self._samples_sent - snapshot.samples_handled,
            max_num_seqs=self.engine.config.scheduler.max_num_seqs,
            max_waiting=self.max_waiting,
        ):
            raise EngineOverloadedError(
                f"the server is overloaded: its waiting queue is full (max_waiting "
                f"{self.max_waiting} beyond the free running slots)"
            )
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = outputs
        stream = RequestStream(self, request_id, outputs, timeout)
        try:
            await self._add(request_id, prompt_token_ids, params, compression)
        except BaseException:
            stream.abort()
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compression: CompressionConfig | dict | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes (see ``add_request``).

        Leaving the iteration early (``aclose``, cancellation) aborts the request.

        Raises:
            ValueError, EngineOverloadedError, EngineDeadError: as ``add_request``.
            EngineDeadError: the loop died while the request ran.
            RequestTimeoutError: ``timeout`` elapsed (the request was aborted).
        """
        stream = await self.add_request(request_id, prompt_token_ids, params, compression, timeout)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def _add(self, request_id, prompt_token_ids, params, compression) -> None:
        added = self._loop.create_future()
        samples = params.n if isinstance(params.n, int) and params.n > 0 else 1  # checked later
        self._samples_sent += samples
        try:
            self._put(
                ("add", request_id, list(prompt_token_ids), params, compression, samples, added)
            )
            while not added.done():
                # A loop that dies between our check and its last drain never answers.
                await asyncio.wait({added}, timeout=IDLE_WAIT_S)
                if not added.done() and not self._thread.is_alive():
                    raise EngineDeadError("the engine is not running")
            added.result()
        finally:
            added.cancel()  # no-op when answered; else the late answer is dropped

    def drop_queue(self, request_id: str) -> None:
        """Stop delivering the request's outputs (its stream finished or gave up)."""
        self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request (non-blocking; done by the loop thread before its next step)."""
        self._put(("abort", request_id))


def admits_request(
    *, num_running: int, num_waiting: int, num_pending: int, max_num_seqs: int, max_waiting: int
) -> bool:
    """``AsyncEngine``'s admission rule: whether a new request may join the queue (pure).

    Samples count, not requests: a request of ``n`` samples counts ``n``. The queued samples
    are those waiting in the engine's published snapshot plus those of requests whose add the
    loop thread has not confirmed yet (``num_pending``); the free running slots,
    ``max_num_seqs - num_running`` (at least 0), take as many of them at the next step, so
    only the rest wait. A new request is admitted while fewer than ``max_waiting`` samples are
    left waiting; its own samples are not counted, so it may take the queue up to ``n - 1``
    samples past ``max_waiting``.

    Args:
        num_running: samples running (the snapshot's ``num_running``).
        num_waiting: samples waiting or preempted (the snapshot's ``num_waiting``).
        num_pending: samples of requests sent to the loop thread and not yet confirmed added.
        max_num_seqs: the most samples running at once.
        max_waiting: the most samples waiting beyond the free running slots.

    Returns:
        True to admit the request; False: the server is overloaded (503).
    """
    free_slots = max(0, max_num_seqs - num_running)
    return num_waiting + num_pending - free_slots < max_waiting
