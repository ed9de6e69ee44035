"""POST /v1/chat/completions: chat template, then one JSON body or ``chat.completion.chunk``s."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sparsekv.engine.prompts import chat_context_tokens, render_chat
from sparsekv.outputs import CompletionOutput, Logprob, RequestOutput
from sparsekv.sampling_params import MAX_LOGPROBS
from sparsekv.server.errors import APIError, invalid_request
from sparsekv.server.protocol import ChatCompletionRequest, ChatMessage
from sparsekv.server.responses import run_to_end, sse_stream, streaming_response
from sparsekv.server.serving import (
    ServerContext,
    new_id,
    response_headers,
    sampling_params,
    start_request,
    usage,
)

RENAMES = {"prompt": "messages"}


def _message_dicts(messages: list[ChatMessage]) -> list[dict]:
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError(
                    400, "only text content parts are supported", param=f"messages.{i}.content"
                )
            content = "".join(part.text for part in content)
        result.append({"role": message.role, "content": content})
    return result


def _num_top_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
    if not body.logprobs:
        if body.top_logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        return None
    return body.top_logprobs or 0


def _logprob_content(tokenizer, token_bytes, records: list[Logprob]) -> list[dict]:
    """OpenAI's ``logprobs.content``; ``bytes`` are the token's raw bytes, so a client can
    rebuild a character split over several tokens (``token`` then shows U+FFFD)."""

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(token_id))}

    return [
        {**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
        for r in records
    ]


class ChatFormatter:
    """Builds chat response bodies and stream chunks for one request."""

    def __init__(self, ctx: ServerContext, request_id: str, body: ChatCompletionRequest) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.created = int(time.time())  # Unix seconds when the request arrived
        self.want_logprobs = body.logprobs
        self.include_usage = body.include_usage
        self.num_choices = body.n
        self.terminated: set[int] = set()

    def _chunk(self, choices: list[dict], usage_value: dict | None = None) -> dict:
        chunk = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage_value
        return chunk

    def first_chunks(self) -> list[dict]:
        """One chunk per choice carrying the role (sent before any token)."""
        return [
            self._chunk([self._choice(i, {"role": "assistant", "content": ""}, None, None)])
            for i in range(self.num_choices)
        ]

    def _choice(self, index, delta, logprobs, finish_reason) -> dict:
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def _logprobs(self, completion: CompletionOutput, records) -> dict | None:
        if not self.want_logprobs or completion.logprobs is None:
            return None
        return {"content": _logprob_content(self.ctx.tokenizer, self.ctx.token_bytes, records)}

    def chunks(self, output: RequestOutput) -> list[dict]:
        """Content deltas, then exactly one terminal chunk per choice."""
        result = []
        for completion in output.outputs:
            num_new = completion.num_delta_tokens
            new = completion.logprobs[-num_new:] if completion.logprobs and num_new else []
            if completion.delta_text or (self.want_logprobs and new):
                delta = {"content": completion.delta_text}
                logprobs = self._logprobs(completion, new)
                result.append(self._chunk([self._choice(completion.index, delta, logprobs, None)]))
            if completion.finish_reason and completion.index not in self.terminated:
                self.terminated.add(completion.index)
                choice = self._choice(completion.index, {}, None, completion.finish_reason)
                result.append(self._chunk([choice]))
        return result

    def cut(self, finish_reason: str) -> list[dict]:
        """Terminal chunks for the choices a cut stream left unfinished."""
        missing = [i for i in range(self.num_choices) if i not in self.terminated]
        self.terminated.update(missing)
        return [self._chunk([self._choice(i, {}, None, finish_reason)]) for i in missing]

    def usage_chunk(self, output: RequestOutput) -> dict:
        """The final chunk with empty ``choices`` and the usage."""
        return self._chunk([], usage(output))

    def response(self, output: RequestOutput) -> dict:
        """The non-streamed ``chat.completion`` body."""
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c, c.logprobs or []),
                "finish_reason": c.finish_reason,
            }
            for c in output.outputs
        ]
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": usage(output),
        }


async def create_chat_completion(
    ctx: ServerContext, body: ChatCompletionRequest, http_request: Request
) -> Response:
    """Serve one chat completion request (streamed or not)."""
    ctx.check_model(body.model)
    ctx.check_available()
    headers = response_headers(body)
    timer = ctx.metrics.timer()  # observed only once the request is admitted
    messages = _message_dicts(body.messages)
    ctx.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
    renames = dict(RENAMES)
    if body.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    try:
        prompt_ids = await asyncio.to_thread(
            render_chat, ctx.tokenizer, messages, body.add_generation_prompt
        )
    except ValueError as exc:
        raise invalid_request(exc, renames) from None
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    # None (OpenAI: up to the end of the context): the engine caps it to what the pool holds.
    params = sampling_params(ctx, body, max_tokens, _num_top_logprobs(body))
    request_id = new_id("chatcmpl")
    ctx.mark_fault(request_id, (m["content"] for m in messages))
    context = None
    given = body.kv_compression.scope if body.kv_compression is not None else None
    if (given or ctx.default_scope) == "context":
        context = await asyncio.to_thread(chat_context_tokens, ctx.tokenizer, messages, prompt_ids)
    stream = await start_request(ctx, request_id, prompt_ids, params, body, renames, context)
    formatter = ChatFormatter(ctx, request_id, body)
    if body.stream:
        usage_chunk = formatter.usage_chunk if body.include_usage else None
        first = formatter.first_chunks()
        events = sse_stream(ctx, stream, timer, first, formatter.chunks, usage_chunk, formatter.cut)
        return streaming_response(ctx, events, stream, headers)
    output = await run_to_end(ctx, http_request, stream, timer)
    if output is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(formatter.response(output), headers=headers)
