"""POST /v1/completions: a text or token-id prompt, one JSON body or ``text_completion`` chunks."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sparsekv.engine.prompts import encode_prompt
from sparsekv.outputs import CompletionOutput, Logprob, RequestOutput
from sparsekv.server.errors import APIError, invalid_request
from sparsekv.server.protocol import CompletionRequest
from sparsekv.server.serving import (
    ServerContext,
    new_id,
    run_to_end,
    sampling_params,
    sse_stream,
    start_request,
    streaming_response,
    usage,
)


def _single_prompt(body: CompletionRequest) -> str | list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(
                400,
                "prompt: batches of prompts are not supported; send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    return prompt


class CompletionFormatter:
    """Builds completion response bodies and stream chunks for one request."""

    def __init__(self, ctx: ServerContext, request_id: str, body: CompletionRequest) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.created = int(time.time())  # Unix seconds when the request arrived
        self.include_usage = body.include_usage
        self.text_offsets: dict[int, int] = {}
        self.terminated: set[int] = set()

    def _chunk(self, choices: list[dict], usage_value: dict | None = None) -> dict:
        chunk = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage_value
        return chunk

    def _logprobs(self, completion: CompletionOutput, records: list[Logprob]) -> dict | None:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
        if completion.logprobs is None:
            return None
        decode = self.ctx.tokenizer.decode
        offset = self.text_offsets.get(completion.index, 0)
        tokens, offsets = [], []
        for record in records:
            text = decode([record.token_id])
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self.text_offsets[completion.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{decode([t]): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }

    @staticmethod
    def _choice(index, text, logprobs, finish_reason) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunks(self, output: RequestOutput) -> list[dict]:
        """Text deltas, then exactly one terminal chunk per choice."""
        result = []
        for completion in output.outputs:
            num_new = completion.num_delta_tokens
            new = completion.logprobs[-num_new:] if completion.logprobs and num_new else []
            if completion.delta_text or new:
                logprobs = self._logprobs(completion, new)
                choice = self._choice(completion.index, completion.delta_text, logprobs, None)
                result.append(self._chunk([choice]))
            if completion.finish_reason and completion.index not in self.terminated:
                self.terminated.add(completion.index)
                choice = self._choice(completion.index, "", None, completion.finish_reason)
                result.append(self._chunk([choice]))
        return result

    def usage_chunk(self, output: RequestOutput) -> dict:
        """The final chunk with empty ``choices`` and the usage."""
        return self._chunk([], usage(output))

    def response(self, output: RequestOutput) -> dict:
        """The non-streamed ``text_completion`` body."""
        choices = [
            self._choice(c.index, c.text, self._logprobs(c, c.logprobs or []), c.finish_reason)
            for c in output.outputs
        ]
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": usage(output),
        }


async def create_completion(
    ctx: ServerContext, body: CompletionRequest, http_request: Request
) -> Response:
    """Serve one completion request (streamed or not)."""
    ctx.check_model(body.model)
    ctx.check_available()
    timer = ctx.metrics.timer()  # observed only once the request is admitted
    prompt = _single_prompt(body)
    try:
        prompt_ids = await asyncio.to_thread(encode_prompt, ctx.tokenizer, prompt)
    except ValueError as exc:
        raise invalid_request(exc) from None
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    params = sampling_params(ctx, body, max_tokens, body.logprobs)
    request_id = new_id("cmpl")
    ctx.mark_fault(request_id, [prompt] if isinstance(prompt, str) else [])
    stream = await start_request(ctx, request_id, prompt_ids, params, body)
    formatter = CompletionFormatter(ctx, request_id, body)
    if body.stream:
        usage_chunk = formatter.usage_chunk if body.include_usage else None
        events = sse_stream(stream, timer, [], formatter.chunks, usage_chunk)
        return streaming_response(events, stream)
    output = await run_to_end(http_request, stream, timer)
    if output is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(formatter.response(output))
