"""The ingress's engine client: the ``AsyncEngine`` methods the server calls, over replicas.

Each request is routed once, at admission (``sparsekv.distributed.routing``), to one replica's
Ray Serve deployment; its outputs stream back through the deployment handle. Loads are the
requests in flight per replica as this ingress counts them (exact and without a round trip).

Failures map to the exceptions of a one-process engine, so the OpenAI layer answers them with
the same bodies: admission errors come back from the replica as values (``Admission``); a replica
that dies or raises mid-request fails that request only, with ``EngineDeadError`` (503
``engine_unavailable``), while Serve restarts the replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from sparsekv.distributed.replica import Admission
from sparsekv.distributed.routing import Router, routing_key
from sparsekv.engine.async_engine import EngineDeadError, EngineSnapshot, RequestTimeoutError
from sparsekv.engine.model_info import ModelInfo
from sparsekv.outputs import RequestOutput
from sparsekv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long /metrics waits for a replica's snapshot before showing its last known one (seconds).
SNAPSHOT_TIMEOUT_S = 2.0


class ReplicaClient:
    """Routes requests to replicas and streams their outputs back.

    Args:
        handles: one Ray Serve deployment handle per replica (``EngineReplica``).
        info: the served model's facts (identical on every replica).
        router: the routing policy.
        prefix_pages: full pages hashed into the routing key.
    """

    def __init__(
        self, handles: Sequence, info: ModelInfo, router: Router, prefix_pages: int
    ) -> None:
        self.handles = list(handles)
        self.info = info
        self.router = router
        self.prefix_pages = prefix_pages
        self.loads = [0] * len(self.handles)
        self.num_routed = [0] * len(self.handles)
        self.streams: dict[str, ReplicaStream] = {}
        self._snapshots = {str(i): EngineSnapshot() for i in range(len(self.handles))}
        self._running = False
        self.error: BaseException | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Accept requests from now on."""
        self._running = True

    @property
    def is_alive(self) -> bool:
        """True between ``start`` and ``shutdown``."""
        return self._running

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request in flight; the replicas themselves belong to Ray Serve."""
        self._running = False
        for stream in list(self.streams.values()):
            stream.abort()

    # ----------------------------------------------------------------- state
    def snapshots(self) -> dict[str, EngineSnapshot]:
        """The replicas' latest fetched states, by replica index (as a label)."""
        return dict(self._snapshots)

    async def refresh(self) -> None:
        """Fetch every replica's snapshot (a replica that does not answer keeps its last)."""

        async def fetch(index: int) -> None:
            try:
                call = self.handles[index].snapshot.remote()
                self._snapshots[str(index)] = await asyncio.wait_for(call, SNAPSHOT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a dead replica must not break /metrics
                logger.warning("replica %d gave no snapshot: %s", index, exc)

        await asyncio.gather(*(fetch(i) for i in range(len(self.handles))))

    # ----------------------------------------------------------------- requests
    def route(self, prompt_token_ids: list[int], compression: dict | None) -> int:
        """The replica for a request: its routing key is its shared context's full pages for
        ``scope: "context"``, else its prompt's first full pages."""
        compression = compression or {}
        context = None
        if compression.get("scope", self.info.default_scope) == "context":
            context = compression.get("context_tokens")
        key = routing_key(prompt_token_ids, self.info.block_size, self.prefix_pages, context)
        return self.router.choose(key, self.loads)

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compression: dict | None = None,
        timeout: float | None = None,
    ) -> ReplicaStream:
        """Route and admit a request (see ``AsyncEngine.add_request``).

        Raises:
            ValueError: invalid input (the replica engine's message).
            EngineOverloadedError: the chosen replica's waiting queue is full.
            EngineDeadError: the ingress is shut down, or the replica failed.
        """
        if not self._running:
            raise EngineDeadError("the engine is not running")
        index = self.route(prompt_token_ids, compression)
        handle = self.handles[index].options(stream=True)
        call = handle.generate.remote(request_id, list(prompt_token_ids), params, compression)
        stream = ReplicaStream(self, index, request_id, call, timeout)
        try:
            admission = await stream.next_item()
            if not isinstance(admission, Admission):
                raise EngineDeadError(f"replica {index} answered {type(admission).__name__}")
            admission.raise_error()
        except BaseException:
            stream.abort()
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compression: dict | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (see ``AsyncEngine.generate``)."""
        stream = await self.add_request(request_id, prompt_token_ids, params, compression, timeout)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request in flight on its replica (unknown ids are ignored)."""
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.abort()


class ReplicaStream:
    """The outputs of one request from its replica, as an async iterator (``RequestStream``'s
    interface).

    Args:
        client: the owning client (loads and streams are released through it).
        index: the replica serving the request.
        request_id: the request.
        call: the streaming deployment response.
        timeout: seconds from now after which the request is aborted.
    """

    def __init__(
        self,
        client: ReplicaClient,
        index: int,
        request_id: str,
        call,
        timeout: float | None,
    ) -> None:
        self.client = client
        self.index = index
        self.request_id = request_id
        self.call = call
        self.timeout = timeout
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout is None else loop.time() + timeout
        self.finished = False
        client.loads[index] += 1
        client.num_routed[index] += 1
        client.streams[request_id] = self

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self.next_item()
        if output.finished:
            self._release()
        return output

    async def next_item(self) -> Admission | RequestOutput:
        """The replica's next item, within the deadline.

        Raises:
            RequestTimeoutError: the deadline passed (the request was aborted).
            EngineDeadError: the replica failed or ended the stream early.
        """
        try:
            if self.deadline is None:
                return await self.call.__anext__()
            remaining = max(0.0, self.deadline - asyncio.get_running_loop().time())
            return await asyncio.wait_for(self.call.__anext__(), remaining)
        except TimeoutError:
            self.abort()
            raise RequestTimeoutError(
                f"the request ran past the server's request timeout of {self.timeout:g} s"
            ) from None
        except StopAsyncIteration:
            self.abort()
            raise EngineDeadError(f"replica {self.index} ended the request early") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any Ray failure fails this request only
            self.abort()
            logger.warning("replica %d failed request %s: %s", self.index, self.request_id, exc)
            raise EngineDeadError(
                f"replica {self.index} failed: {type(exc).__name__}: {_first_line(exc)}"
            ) from None

    def abort(self) -> None:
        """Stop the request on its replica (if still running); idempotent."""
        if self.finished:
            return
        self._release()
        self.call.cancel()
        try:  # explicit as well: a cancelled call may not reach a replica that is busy
            self.client.handles[self.index].abort.remote(self.request_id)
        except Exception as exc:  # noqa: BLE001 - a dead replica has nothing to abort
            logger.warning("abort of %s on replica %d failed: %s", self.request_id, self.index, exc)

    def _release(self) -> None:
        self.finished = True
        self.client.loads[self.index] -= 1
        self.client.streams.pop(self.request_id, None)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
