"""Pure ASGI middleware: API-key check on /v1, the drain gate, and the request-body limit.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses and disconnect detection pass
through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparsekv.server.errors import APIError


async def _send_error(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    await error.response()(scope, receive, send)


def _is_api_path(scope: Scope) -> bool:
    path = scope.get("path", "")
    return scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/"))


def _bearer_token(header: bytes) -> bytes | None:
    """The credentials of an ``Authorization`` header whose scheme is ``Bearer`` (the scheme
    is case-insensitive, RFC 7235), else ``None``."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every path under ``/v1`` (401 otherwise).

    /health and /metrics stay open. The scheme is matched case-insensitively; the key is
    compared in constant time.

    Args:
        app: the wrapped ASGI app.
        api_key: the expected key; ``None`` disables the check.
    """

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and _is_api_path(scope):
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            token = _bearer_token(header)
            if token is None or not hmac.compare_digest(token, self.expected):
                error = APIError(401, "invalid or missing API key", code="invalid_api_key")
                await _send_error(scope, receive, send, error)
                return
        await self.app(scope, receive, send)


class DrainMiddleware:
    """Count the /v1 requests being answered; while draining, answer new ones 503.

    A streamed response counts until its last event is sent, so the count reaching 0 means
    every in-flight request has been answered.

    Args:
        app: the wrapped ASGI app.
        ctx: has ``is_draining`` and ``num_in_flight`` (the ``ServerContext``).
        draining_error: builds the 503 answered while draining.
    """

    def __init__(self, app: ASGIApp, ctx, draining_error: Callable[[], APIError]) -> None:
        self.app = app
        self.ctx = ctx
        self.draining_error = draining_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_api_path(scope):
            await self.app(scope, receive, send)
            return
        if self.ctx.is_draining:
            response = self.draining_error().response()
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        self.ctx.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.ctx.num_in_flight -= 1


class BodyLimitMiddleware:
    """Reject request bodies over ``max_bytes`` with 413, by Content-Length and by actual size.

    The body is read up front (at most ``max_bytes``) and replayed to the app; later
    ``receive`` calls go to the server, so disconnects are still seen.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the largest accepted body in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body exceeds the server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(scope, receive, send, self._too_large())
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(scope, receive, send, self._too_large())
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
