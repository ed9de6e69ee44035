"""What both endpoints share: server state, sampling params, admission, usage and headers
(the two ways of answering are in ``responses``).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparsekv.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineSnapshot,
    RequestStream,
)
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.engine.model_info import ModelInfo
from sparsekv.engine.prompts import max_prompt_chars
from sparsekv.engine.token_bytes import TokenBytes
from sparsekv.outputs import RequestOutput
from sparsekv.sampling_params import SamplingParams
from sparsekv.server.errors import APIError, invalid_request
from sparsekv.server.faults import StepFaultInjector
from sparsekv.server.metrics import ServerMetrics
from sparsekv.server.protocol import SamplingBody

logger = logging.getLogger(__name__)

# Response header listing the request's unknown (ignored) top-level fields.
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"


@dataclass
class ServerSettings:
    """HTTP-side settings (the ``sparsekv serve`` flags).

    Attributes:
        api_key: required ``Bearer`` key on /v1 (``None`` = open).
        max_body_bytes: largest request body (413 past it).
        request_timeout: seconds before a request is aborted (``None`` = no limit).
        shutdown_timeout: seconds in-flight requests may run after SIGTERM before they are
            aborted (new requests get 503 ``draining`` meanwhile).
        fault_marker: test-only: prompts containing it fail in their first engine step.
    """

    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    request_timeout: float | None = None
    shutdown_timeout: float = 30.0
    fault_marker: str | None = None


class ServerContext:
    """Per-app state: the engine client, settings, metrics and readiness flags.

    The engine client is an ``AsyncEngine`` (one process) or an object with the same methods
    that forwards to replicas (``sparsekv.server.replica_client``): ``start``, ``shutdown``,
    ``add_request``, ``generate``, ``abort``, ``is_alive``, ``error`` and ``refresh``.

    Args:
        engine: the engine client (its loop starts with the app).
        info: the served model's facts.
        settings: HTTP-side settings.
        snapshots: engine state per replica label for /metrics (``""``: one unlabelled engine).
        faults: the test-only step fault injector, if installed.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        info: ModelInfo,
        settings: ServerSettings,
        snapshots: Callable[[], dict[str, EngineSnapshot]],
        faults: StepFaultInjector | None = None,
    ) -> None:
        self.settings = settings
        self.faults = faults
        self.engine = engine
        self.info = info
        self.metrics = ServerMetrics(snapshots, info.prefix_caching)
        self.model_name = info.model_name
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.max_num_seqs = info.max_num_seqs
        self.default_scope = info.default_scope
        self.prefix_caching = info.prefix_caching
        self.token_bytes = TokenBytes(info.tokenizer)
        self.created = int(time.time())
        self.is_ready = False
        self.is_draining = False
        self.num_in_flight = 0  # /v1 HTTP requests being answered (DrainMiddleware counts)
        self.running_ids: set[str] = set()  # engine requests of this server not yet ended

    @classmethod
    def local(cls, engine: LLMEngine, settings: ServerSettings) -> ServerContext:
        """The context of a server around one in-process engine."""
        faults = StepFaultInjector(engine.runner) if settings.fault_marker else None
        client = AsyncEngine(engine)
        return cls(client, ModelInfo.of(engine), settings, lambda: {"": client.snapshot()}, faults)

    @property
    def max_prompt_chars(self) -> int:
        """Longest text prompt worth tokenizing (longer ones can never fit the context)."""
        return max_prompt_chars(self.token_bytes, self.max_model_len)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 before tokenizing a text that can never fit in the context."""
        bound = self.max_prompt_chars
        if num_chars > bound:
            raise APIError(
                400,
                f"{param}: {num_chars} characters can never fit in the context of "
                f"{self.max_model_len} tokens (at most {bound} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def abort_running(self) -> None:
        """Abort every engine request of this server (shutdown timeout); their clients get
        a final chunk and an ``aborted`` error."""
        for request_id in list(self.running_ids):
            self.engine.abort(request_id)

    def check_available(self) -> None:
        """Raise 503 unless the server is ready, not draining, and its engine loop alive."""
        if self.is_draining:
            raise draining_error()
        if not self.is_ready:
            raise APIError(503, "the server is starting up", code="not_ready")
        if not self.engine.is_alive:
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")

    def check_model(self, model: str | None) -> None:
        """404 for a model id other than the served one (``None`` = the served one)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def mark_fault(self, request_id: str, texts: Iterable[str]) -> None:
        """Test-only: fail ``request_id``'s first step if its prompt holds the fault marker."""
        marker = self.settings.fault_marker
        if self.faults is not None and marker and any(marker in t for t in texts):
            self.faults.mark(request_id)


def draining_error() -> APIError:
    """The 503 answered to new requests while the server drains after SIGTERM."""
    return APIError(
        503,
        "the server is shutting down and accepts no new requests; retry on another replica",
        code="draining",
    )


def new_id(prefix: str) -> str:
    """An OpenAI-style id such as ``chatcmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(
    ctx: ServerContext,
    body: SamplingBody,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """``SamplingParams`` from the body's fields (validated later by the engine)."""
    if body.n > ctx.max_num_seqs:
        raise APIError(400, f"n must be <= max_num_seqs ({ctx.max_num_seqs})", param="n")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise APIError(400, "best_of: only best_of = n is supported", param="best_of")
    return SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        speculative=body.speculative.overrides() if body.speculative is not None else None,
    )


async def start_request(
    ctx: ServerContext,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    body: SamplingBody,
    renames: dict[str, str] | None = None,
    context_tokens: int | None = None,
) -> RequestStream:
    """Admit a request into the engine; user errors become 400s, overload a 503.

    Args:
        renames: engine parameter names to this endpoint's names (chat: prompt -> messages).
        context_tokens: a chat prompt's shared context length, used when the request's scope
            is ``context`` and the client gave none (0: nothing to compress).
    """
    compression = body.kv_compression.overrides() if body.kv_compression is not None else None
    scope = (compression or {}).get("scope", ctx.default_scope)
    if scope == "context" and context_tokens is None and "scope" not in (compression or {}):
        # A server-wide context scope: a completion that names no context compresses its prompt.
        if "context_tokens" not in (compression or {}):
            compression = dict(compression or {}) | {"scope": "prompt"}
    elif scope == "context" and context_tokens is not None:
        compression = dict(compression or {})
        if "context_tokens" not in compression:
            if context_tokens > 0:
                compression["context_tokens"] = context_tokens
            else:  # no message before the last user message: nothing is shared context
                compression |= {"method": "none", "scope": "prompt"}
    try:
        stream = await ctx.engine.add_request(
            request_id, prompt_token_ids, params, compression, ctx.settings.request_timeout
        )
        ctx.running_ids.add(request_id)
        return stream
    except ValueError as exc:
        raise invalid_request(exc, renames) from None
    except EngineOverloadedError as exc:
        raise APIError(503, str(exc), code="overloaded") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from None


# The most characters X-Ignored-Fields carries (a client may send thousands of names).
IGNORED_FIELDS_MAX_CHARS = 1024
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def response_headers(body: SamplingBody) -> dict[str, str]:
    """Headers every answer carries: ``X-Ignored-Fields`` lists the body's unknown fields
    (also logged, once per request), as vLLM warns about them.

    The names are the client's own text. A name of letters, digits and ``_.-`` is listed as
    it is; any other is JSON-quoted with ``\\uXXXX`` escapes, so the value is printable ASCII
    that neither starts nor ends with a space (a header is Latin-1 and a CR or LF would end
    it) and ``", "`` only separates names. The list stops before ``IGNORED_FIELDS_MAX_CHARS``
    characters with ``... (N more)``; the log line carries the same text."""
    ignored = body.ignored_fields
    if not ignored:
        return {}
    names = [n if _PLAIN_NAME.fullmatch(n) else json.dumps(n) for n in ignored]
    value = ", ".join(names)
    if len(value) > IGNORED_FIELDS_MAX_CHARS:
        room = IGNORED_FIELDS_MAX_CHARS - len(f", ... ({len(names)} more)")
        kept, length = [], -2  # the first name has no separator
        for name in names:
            length += len(name) + 2
            if length > room:
                break
            kept.append(name)
        value = ", ".join(kept + [f"... ({len(names) - len(kept)} more)"])
    logger.warning("ignored unknown request fields: %s", value)
    return {IGNORED_FIELDS_HEADER: value}


def usage(output: RequestOutput) -> dict:
    """OpenAI usage plus the request's KV footprint at its end, per token.

    ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache
    (``RequestOutput.num_cached_tokens``: once per request, as ``prompt_tokens``); always
    present, 0 with prefix caching off.

    ``kv_tokens_kept``: slots the cache held, averaged over layers; ``kv_tokens_full``: the
    slots a full cache holds per layer (the request's computed tokens);
    ``kv_compression_ratio``: the fraction of the full cache that compression removed;
    ``kv_sliding_window_ratio``: the fraction the model's sliding-window layers no longer hold
    (Gemma 3), so that ``1 - kept / full`` is the sum of the two ratios.
    """
    num_prompt = len(output.prompt_token_ids)
    num_completion = sum(len(c.token_ids) for c in output.outputs)
    stats = output.kv_stats
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
        "kv_tokens_kept": round(stats.tokens_kept, 4) if stats is not None else 0.0,
        "kv_tokens_full": stats.tokens_full if stats is not None else 0,
        "kv_compression_ratio": stats.compression_ratio if stats is not None else 0.0,
        "kv_sliding_window_ratio": stats.window_ratio if stats is not None else 0.0,
    }
