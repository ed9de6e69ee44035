"""``EngineLoop``: the loop-thread half of ``AsyncEngine`` (``engine.async_engine``).

It holds the state both halves share (the command queue, the per-request output queues, the
published ``EngineSnapshot``) and everything the background thread runs: draining the commands
between steps (add, abort, stop), stepping the engine, publishing the snapshot, and handing
outputs and errors back to the event loop with ``loop.call_soon_threadsafe``. ``AsyncEngine``
subclasses it with the event-loop half (start, admission, the request streams).

An exception escaping the loop marks the engine dead: every pending request fails with
``EngineDeadError`` and the thread stops.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading

from sparsekv.engine.async_types import EngineDeadError, EngineSnapshot
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.outputs import RequestOutput

__all__ = ["IDLE_WAIT_S", "EngineLoop", "resolve_future"]

logger = logging.getLogger("sparsekv.engine.async_engine")  # AsyncEngine's, which users filter on

# How long the idle loop sleeps between checks of its stop flag (seconds); commands wake it.
IDLE_WAIT_S = 0.5


class EngineLoop:
    """The loop thread's side of ``AsyncEngine``: its state and the code it runs.

    Commands are tuples put on ``_commands`` (``_put``, from any thread): ``("add", request_id,
    prompt_token_ids, params, compression, samples, future)``, ``("abort", request_id)`` and
    ``("stop",)``. The thread itself (``_thread``, started by ``AsyncEngine.start``) runs
    ``_run``.

    Args:
        engine: the engine to drive; no other thread may call it once the loop runs.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._active: set[str] = set()  # loop thread only: requests added and not finished
        # Samples (n per request) of the adds sent to the loop thread (event-loop side) and of
        # those it has handled, added or refused (loop-thread side, published in the snapshot
        # together with the waiting count it changed): their difference is in neither count.
        self._samples_sent = 0
        self._samples_handled = 0
        self._snapshot = EngineSnapshot()
        self.error: BaseException | None = None

    def _put(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if self._stopping:
                    break
                if not self.engine.has_unfinished_requests():
                    self._publish_snapshot()
                    self._wakeup.wait(IDLE_WAIT_S)
                    self._wakeup.clear()
                    check = getattr(self.engine, "check_health", None)
                    if check is not None:  # a rank that died while idle ends the loop
                        check()
                    fatal = getattr(self.engine, "fatal_error", None)
                    if fatal is not None:
                        raise RuntimeError(fatal)
                    continue
                outputs = self.engine.step()
                self._publish_snapshot()
                self._deliver(outputs)
                fatal = getattr(self.engine, "fatal_error", None)
                if fatal is not None:  # a tensor-parallel rank failed: no step can run
                    raise RuntimeError(fatal)
                if not outputs:
                    self._wakeup.wait(0.001)  # nothing schedulable yet: do not spin
                    self._wakeup.clear()
            self._abort_all()
        except BaseException as exc:  # noqa: BLE001 - a dead loop must be reported, not hidden
            logger.exception("the engine loop died")
            self.error = exc
            self._stopping = True
            self._fail_all(EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}"))
        finally:
            stop = getattr(self.engine, "shutdown", None)
            if stop is not None:
                stop()  # the engine's other processes (tensor-parallel ranks)

    def _drain_commands(self) -> None:
        handled = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            handled = True
            kind = command[0]
            if kind == "add":
                self._handle_add(*command[1:])
            elif kind == "abort":
                self._handle_abort(command[1])
            elif kind == "stop":
                self._stopping = True
        if handled:
            self._publish_snapshot()

    def _handle_add(
        self, request_id, prompt_token_ids, params, compression, samples, added
    ) -> None:
        self._samples_handled += samples  # published with the waiting count it changes
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, compression)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller
            self._call_soon(resolve_future, added, exc)
            return
        self._active.add(request_id)
        self._call_soon(resolve_future, added, None)

    def _handle_abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._deliver([output])

    def _abort_all(self) -> None:
        for request_id in list(self._active):
            self._handle_abort(request_id)
        self._fail_pending_commands(EngineDeadError("the engine was shut down"))
        self._publish_snapshot()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self._active.discard(output.request_id)
        if outputs:
            self._call_soon(self._dispatch, outputs)

    def _dispatch(self, outputs: list) -> None:
        """Event-loop side: route outputs to their requests' queues (unknown ids are dropped)."""
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is not None:
                target.put_nowait(output)

    def _fail_all(self, exc: Exception) -> None:
        self._fail_pending_commands(exc)

        def fail_queues() -> None:
            for target in self._queues.values():
                target.put_nowait(exc)

        self._call_soon(fail_queues)

    def _fail_pending_commands(self, exc: Exception) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._samples_handled += command[-2]
                self._call_soon(resolve_future, command[-1], exc)

    def _call_soon(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _publish_snapshot(self) -> None:
        engine = self.engine
        usage = engine.kv_usage()
        self._snapshot = EngineSnapshot(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            num_pages_used=int(usage["pages_used"]),
            num_pages_total=int(usage["pages_total"]),
            compression_ratio=float(usage["compression_ratio"]),
            stats=copy.deepcopy(engine.stats),  # nested counters too
            samples_handled=self._samples_handled,
        )


def resolve_future(future: asyncio.Future, exc: BaseException | None) -> None:
    """Event-loop side: answer an add's ``future`` (``None``: added; else the error raised to
    its caller), unless it was answered or cancelled already."""
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
