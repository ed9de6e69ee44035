"""The OpenAI-compatible HTTP server: FastAPI app, lifespan, and ``sparsekv serve``.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET and HEAD /v1/models, GET and HEAD
/health (a probe that sends HEAD gets the status without a body), GET /metrics; another method
on one of them is a 405 naming the methods it takes, an unknown path under /v1 a 404.
Readiness: /health answers 200 only once the model is loaded and a one-token warm-up generation
has run, and 503 if the engine loop died or the server is draining.

Drain: on SIGTERM (or SIGINT) the listener stays open; new /v1 requests get 503 with the code
``draining`` while the requests in flight finish, for at most ``--shutdown-timeout`` seconds
(then they are aborted: a stream gets a final chunk and an error event). The server then
exits with status 0. A second signal exits at once, with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Match, Route

from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.sampling_params import SamplingParams
from sparsekv.server.chat import create_chat_completion
from sparsekv.server.completions import create_completion
from sparsekv.server.errors import APIError, install_error_handlers, method_not_allowed
from sparsekv.server.faults import FAULT_MARKER_ENV
from sparsekv.server.metrics import CONTENT_TYPE
from sparsekv.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, DrainMiddleware
from sparsekv.server.protocol import ChatCompletionRequest, CompletionRequest
from sparsekv.server.serving import ServerContext, ServerSettings, draining_error

logger = logging.getLogger("sparsekv.server")

API_KEY_ENV = "SPARSEKV_API_KEY"
# After the shutdown timeout aborted the requests in flight, how long their answers may take.
ABORT_GRACE_S = 5.0


async def warm_up(ctx: ServerContext) -> None:
    """Run a one-token greedy generation so the first user request pays no first-call costs.

    It is not traffic: /metrics shows the engine counters less what they held once it ended
    (its prompt and generated tokens, its prefix-cache lookup; with replicas, their own
    warm-ups too), and it is observed in no latency histogram.

    Raises:
        RuntimeError: the warm-up generation failed.
    """
    prompt_ids = list(ctx.tokenizer("Hello", add_special_tokens=True)["input_ids"]) or [0]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    final = None
    async for output in ctx.engine.generate("warmup", prompt_ids, params):
        final = output
    if final is None or final.error is not None:
        raise RuntimeError(f"warm-up generation failed: {final.error if final else 'no output'}")
    # A local engine published its counters before it handed out the final output; replicas
    # are asked for theirs.
    await ctx.engine.refresh()
    ctx.metrics.exclude_counts_so_far()


def _lifespan(ctx: ServerContext):
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        ctx.engine.start()
        await warm_up(ctx)
        await asyncio.to_thread(lambda: ctx.max_prompt_chars)  # one pass over the vocabulary
        if ctx.info.prefix_caching_requested and not ctx.prefix_caching:
            logger.warning(
                "prefix caching is off: %s has sliding-window layers, whose pages past the "
                "window are freed and cannot be shared",
                ctx.model_name,
            )
        ctx.is_ready = True
        logger.info("sparsekv is ready: serving %s", ctx.model_name)
        try:
            yield
        finally:
            ctx.is_draining = True
            await ctx.engine.shutdown()
            logger.info("engine stopped")

    return lifespan


def create_app(engine: LLMEngine, settings: ServerSettings | None = None) -> FastAPI:
    """Build the app around a loaded engine (its loop starts with the app's lifespan).

    Args:
        engine: the loaded engine; the app owns it from now on.
        settings: HTTP-side settings (defaults: open, 8 MiB bodies, no timeout).
    """
    return create_app_for(ServerContext.local(engine, settings or ServerSettings()))


def create_app_for(ctx: ServerContext) -> FastAPI:
    """Build the app around a server context (one engine, or the replicas' client)."""
    app = FastAPI(title="sparsekv", lifespan=_lifespan(ctx))
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        if ctx.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if ctx.is_ready and not ctx.engine.is_alive:
            detail = repr(ctx.engine.error) if ctx.engine.error else "stopped"
            return JSONResponse({"status": "dead", "error": detail}, status_code=503)
        if not ctx.is_ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        await ctx.engine.refresh()
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(ctx)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        ctx.check_model(model_id)
        return _model_card(ctx)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _guarded(create_completion(ctx, body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _guarded(create_chat_completion(ctx, body, request))

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def unknown(path: str, request: Request) -> Response:
        allowed = _allowed_methods(app, request)
        if allowed:
            raise method_not_allowed(request.method, f"/v1/{path}", allowed)
        raise APIError(404, f"unknown endpoint /v1/{path}", code="not_found")

    app.add_middleware(BodyLimitMiddleware, max_bytes=ctx.settings.max_body_bytes)
    app.add_middleware(DrainMiddleware, ctx=ctx, draining_error=draining_error)
    app.add_middleware(APIKeyMiddleware, api_key=ctx.settings.api_key)  # outermost: auth first
    return app


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods of the endpoints whose path is the request's but whose method is not.

    The /v1 catch-all takes every usual method, so Starlette's router matches it fully (a 404)
    before it would answer a wrong method on a real endpoint with a 405; the catch-all asks
    here instead.
    """
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.methods:
            match, _ = route.matches(request.scope)
            if match is Match.PARTIAL:
                methods |= route.methods
    return sorted(methods)


async def _guarded(handler: Awaitable[Response]) -> Response:
    """Answer an unexpected error with a 500 body here: Starlette's catch-all handler would
    re-raise it and uvicorn would then drop the keep-alive connection."""
    try:
        return await handler
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001
        logger.exception("request failed")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def _model_card(ctx: ServerContext) -> dict:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "sparsekv",
        "max_model_len": ctx.max_model_len,
        "prefix_caching": ctx.prefix_caching,
    }


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on the first SIGTERM/SIGINT and an exit on the second.

    uvicorn would close its listener at the first signal; here the app keeps serving (503
    ``draining`` for new /v1 requests) until the requests in flight are answered or the
    shutdown timeout aborted them, and only then shuts uvicorn down.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_started: float | None = None
        self.aborted_at: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_started is not None:
            logger.warning("second signal: exiting now, in-flight requests are cut")
            os._exit(1)
        logger.info("draining: %d requests in flight", self.ctx.num_in_flight)
        self.ctx.is_draining = True
        self.drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            self.should_exit = self._drained(time.monotonic())
        return await super().on_tick(counter)

    def _drained(self, now: float) -> bool:
        if self.ctx.num_in_flight == 0:
            return True
        if self.aborted_at is None:
            if now - self.drain_started >= self.ctx.settings.shutdown_timeout:
                logger.warning("shutdown timeout: aborting %d requests", len(self.ctx.running_ids))
                self.ctx.abort_running()
                self.aborted_at = now
            return False
        return now - self.aborted_at >= ABORT_GRACE_S


def serve(args: argparse.Namespace) -> int:
    """``sparsekv serve``: load the model, warm up, and serve until SIGTERM (exit code 0).

    On SIGTERM the server drains (see the module docstring), then the lifespan shutdown
    aborts whatever is left and stops the engine loop.

    Raises:
        ValueError: invalid flags or a missing model.
    """
    from sparsekv.cli_args import engine_config_from_args
    from sparsekv.host_allocator import tune_host_allocator

    # Before any other thread allocates: the engine steps in its own thread, which reuses
    # freed activations only once every thread shares glibc's main arena (host_allocator).
    tune_host_allocator()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = engine_config_from_args(args)
    settings = ServerSettings(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        shutdown_timeout=args.shutdown_timeout,
        fault_marker=os.environ.get(FAULT_MARKER_ENV) or None,
    )
    if settings.max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    if settings.request_timeout is not None and not settings.request_timeout > 0:  # NaN too
        raise ValueError("request_timeout must be > 0 seconds")
    if not settings.shutdown_timeout >= 0:
        raise ValueError("shutdown_timeout must be >= 0 seconds")
    if settings.fault_marker:
        logger.warning("test-only fault injection is on (%s)", FAULT_MARKER_ENV)
    if config.parallel.data_parallel_size > 1:
        from sparsekv.server.ingress import start_ingress

        app, cluster = start_ingress(config, settings)
        try:
            return _run(app, args)
        finally:
            cluster.shutdown()
    if config.parallel.threads_per_rank is not None:
        torch.set_num_threads(config.parallel.threads_per_rank)
    logger.info("loading %s", config.model.model)
    return _run(create_app(LLMEngine(config), settings), args)


def _run(app: FastAPI, args: argparse.Namespace) -> int:
    """Serve ``app`` with uvicorn until SIGTERM; the exit code of ``sparsekv serve``."""
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=ABORT_GRACE_S,  # the drain already waited
    )
    server = _DrainingServer(uv_config, app.state.ctx)
    # uvicorn re-raises the caught signal after its graceful shutdown; with the default
    # handlers that would kill the process (SIGTERM) or raise KeyboardInterrupt (SIGINT).
    # No-op handlers make the drained shutdown exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    server.run()
    return 0 if server.started else 1
