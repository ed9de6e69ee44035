"""What ``AsyncEngine`` hands its callers: its errors, its state snapshot, a request's stream.

A ``RequestStream`` reads the per-request ``asyncio.Queue`` the engine's loop thread feeds; it
aborts the request when its deadline passes or its consumer stops early.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparsekv.engine.stats import EngineStats
from sparsekv.outputs import RequestOutput

if TYPE_CHECKING:
    from sparsekv.engine.async_engine import AsyncEngine


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it died, or the engine was shut down)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``SchedulerConfig.max_waiting``); retry later."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its timeout and was aborted."""


@dataclass
class EngineSnapshot:
    """Engine state published by the loop thread after every step and command batch.

    Attributes:
        num_running: requests (samples) running.
        num_waiting: requests (samples) waiting or preempted.
        num_pages_used: pool pages in use.
        num_pages_total: pool pages in all.
        compression_ratio: engine-wide effective ratio over running requests
            (``1 - held slots / (layers x tokens)``).
        stats: a copy of the engine's monotonic counters.
        samples_handled: samples of all the adds the loop thread has handled so far (added or
            refused); the admission check counts those sent beyond it as pending, so that a
            request is counted once, in ``num_waiting`` or pending, never twice or not at all.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_pages_used: int = 0
    num_pages_total: int = 0
    compression_ratio: float = 0.0
    stats: EngineStats = field(default_factory=EngineStats)
    samples_handled: int = 0


class RequestStream:
    """The outputs of one request, in order, as an async iterator (see ``AsyncEngine``).

    Args:
        engine: the owning engine.
        request_id: the request.
        outputs: the queue the engine's loop feeds.
        timeout: seconds from now after which the request is aborted.
    """

    def __init__(
        self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue, timeout: float | None
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.outputs = outputs
        self.timeout = timeout
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout is None else loop.time() + timeout
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._next()
        if isinstance(item, BaseException):
            self.abort()
            raise item
        if item.finished:
            self.finished = True
            self.engine.drop_queue(self.request_id)
        return item

    async def _next(self):
        if self.deadline is None:
            return await self.outputs.get()
        remaining = max(0.0, self.deadline - asyncio.get_running_loop().time())
        try:
            return await asyncio.wait_for(self.outputs.get(), remaining)
        except TimeoutError:
            self.abort()
            raise RequestTimeoutError(
                f"the request ran past the server's request timeout of {self.timeout:g} s"
            ) from None

    def abort(self) -> None:
        """Stop the request (if still running) and its deliveries; idempotent."""
        self.engine.drop_queue(self.request_id)
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
