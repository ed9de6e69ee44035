"""The two ways of answering a request: one JSON body once it ends (polling for a client
that leaves), or a server-sent-event stream ending in ``data: [DONE]``, as OpenAI's API does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import suppress

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from sparsekv.engine.async_engine import EngineDeadError, RequestStream, RequestTimeoutError
from sparsekv.outputs import RequestOutput
from sparsekv.server.errors import APIError
from sparsekv.server.metrics import RequestTimer
from sparsekv.server.serving import ServerContext

logger = logging.getLogger(__name__)

# How often a non-streaming request checks whether its client went away (seconds).
DISCONNECT_POLL_S = 0.1


def check_output(output: RequestOutput) -> None:
    """Raise the API error for an output that failed (step error) or was aborted by the server."""
    if output.error is not None:
        raise APIError(500, output.error, code="engine_error")
    if any(c.finish_reason == "abort" for c in output.outputs):
        raise APIError(503, "the request was aborted by the server", code="aborted")


def as_api_error(exc: BaseException) -> APIError:
    """Map an engine-side failure while a request runs to its API error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), code="request_timeout")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


_ENGINE_ERRORS = (APIError, RequestTimeoutError, EngineDeadError)


async def run_to_end(
    ctx: ServerContext, http_request: Request, stream: RequestStream, timer: RequestTimer
) -> RequestOutput | None:
    """Consume a request to its final output; ``None`` if the client disconnected first.

    The client is polled every ``DISCONNECT_POLL_S``; a disconnect aborts the request at once
    (its pages return to the pool before the engine's next step).

    Raises:
        APIError: the request failed, timed out or was aborted by the server.
    """

    async def consume() -> RequestOutput:
        final = None
        async for output in stream:
            timer.observe(output)
            final = output
        if final is None:
            raise EngineDeadError("the request ended without an output")
        check_output(final)
        return final

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                try:
                    return task.result()
                except _ENGINE_ERRORS as exc:
                    raise as_api_error(exc) from None
            if await http_request.is_disconnected():
                return None
    finally:
        stream.abort()
        ctx.running_ids.discard(stream.request_id)
        timer.finish()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task


def sse(data: dict | str) -> str:
    """One server-sent event ``data:`` line pair."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def sse_stream(
    ctx: ServerContext,
    stream: RequestStream,
    timer: RequestTimer,
    first: list[dict],
    chunks: Callable[[RequestOutput], list[dict]],
    usage_chunk: Callable[[RequestOutput], dict] | None,
    cut: Callable[[str], list[dict]],
) -> AsyncIterator[str]:
    """SSE framing: ``first`` chunks, chunks per output, optional usage chunk, ``[DONE]``.

    A stream cut mid-way (request timeout, abort at shutdown, a failed step) first gets
    ``cut(finish_reason)``: a terminal chunk for every choice not yet finished, with
    ``finish_reason`` ``abort`` (or ``error`` for a failed step), then the ``{"error": ...}``
    event, then ``[DONE]``. A client that disconnects cancels this generator (Starlette),
    which aborts the request.
    """
    try:
        for chunk in first:
            yield sse(chunk)
        final = None
        async for output in stream:
            timer.observe(output)
            for chunk in chunks(output):
                yield sse(chunk)
            check_output(output)
            final = output
        if usage_chunk is not None and final is not None:
            yield sse(usage_chunk(final))
    except _ENGINE_ERRORS as exc:
        error = as_api_error(exc)
        for chunk in cut("error" if error.code == "engine_error" else "abort"):
            yield sse(chunk)
        yield sse(error.body())
    except Exception as exc:  # noqa: BLE001 - a bug must end the stream cleanly, not cut it
        logger.exception("stream failed")
        yield sse(as_api_error(exc).body())
    finally:
        stream.abort()
        ctx.running_ids.discard(stream.request_id)
        timer.finish()
    yield sse("[DONE]")


def streaming_response(
    ctx: ServerContext, events: AsyncIterator[str], stream: RequestStream, headers: dict
) -> StreamingResponse:
    """An ``text/event-stream`` response; the request is aborted when the response ends.

    The background abort also covers a client that leaves before the first event, when the
    event generator never started (so its own cleanup never runs).
    """

    async def abort() -> None:
        stream.abort()
        ctx.running_ids.discard(stream.request_id)

    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        background=BackgroundTask(abort),
    )
