"""POST /v1/completions: a text or token-id prompt, one JSON body or ``text_completion`` chunks.

``echo`` puts the prompt before the generated text and, with ``logprobs``, the prompt tokens
before the generated ones in the legacy logprobs object (the first prompt token's logprob and
top logprobs are ``null``, as in OpenAI's legacy API and vLLM): what lm-evaluation-harness's
``local-completions`` reads to score multiple-choice tasks. vLLM's ``prompt_logprobs`` adds a
``prompt_logprobs`` list to each choice.

The logprobs objects are built by ``completion_logprobs.LegacyLogprobs``.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sparsekv.engine.detokenizer import unfinished_tail
from sparsekv.engine.prompts import encode_prompt
from sparsekv.outputs import CompletionOutput, RequestOutput
from sparsekv.server.completion_logprobs import LegacyLogprobs
from sparsekv.server.errors import APIError, invalid_request
from sparsekv.server.protocol import CompletionRequest
from sparsekv.server.responses import run_to_end, sse_stream, streaming_response
from sparsekv.server.serving import (
    ServerContext,
    new_id,
    response_headers,
    sampling_params,
    start_request,
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
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    return prompt


def _num_prompt_logprobs(body: CompletionRequest) -> int | None:
    """Top-N of the prompt logprobs to compute (``None``: none are needed)."""
    wanted = [body.prompt_logprobs]
    if body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    given = [n for n in wanted if n is not None]
    return max(given) if given else None


class CompletionFormatter:
    """Builds completion response bodies and stream chunks for one request.

    Args:
        prompt_text: the echoed prompt (``""`` without ``echo``).
        echo_as_sent: the prompt was text, echoed as the client sent it (its special tokens'
            text included whatever ``skip_special_tokens`` says).
    """

    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        body: CompletionRequest,
        prompt_text: str,
        echo_as_sent: bool = False,
    ) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.created = int(time.time())  # Unix seconds when the request arrived
        self.include_usage = body.include_usage
        self.echo = body.echo
        self.num_logprobs = body.logprobs
        self.want_prompt_logprobs = body.prompt_logprobs is not None
        self.prompt_text = prompt_text
        self.echoed: set[int] = set()
        self.terminated: set[int] = set()
        self.text_lengths: dict[int, int] = {}  # per choice: characters streamed so far
        # Generated tokens (and echoed token-id prompts) go into the text decoded with
        # skip_special_tokens; an echoed text prompt is the client's text as sent.
        self.logprobs = LegacyLogprobs(
            ctx.tokenizer, ctx.token_bytes, prompt_text, body.echo, echo_as_sent,
            body.skip_special_tokens, body.logprobs,
        )  # fmt: skip

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

    def _choice(self, index, text, logprobs, finish_reason) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _records(
        self, output: RequestOutput, completion: CompletionOutput, new: list
    ) -> tuple[list, int]:
        """The records a choice's logprobs list now and how many lead with the echoed
        prompt."""
        if self.echo and completion.index not in self.echoed:
            echo = self.logprobs.echo_records(output)
            return echo + new, len(echo)
        return new, 0

    def chunks(self, output: RequestOutput) -> list[dict]:
        """Text deltas (the echoed prompt first), then one terminal chunk per choice."""
        result = []
        for completion in output.outputs:
            num_new = completion.num_delta_tokens
            new = completion.logprobs[-num_new:] if completion.logprobs and num_new else []
            echo = self.echo and completion.index not in self.echoed
            text = (self.prompt_text if echo else "") + completion.delta_text
            length = self.text_lengths.get(completion.index, 0) + len(text)
            self.text_lengths[completion.index] = length
            if text or new or echo:
                logprobs = None
                if self.num_logprobs is not None:
                    records, num_echo = self._records(output, completion, new)
                    end = length if completion.finished else None
                    logprobs = self.logprobs.build(output, completion.index, records, num_echo, end)
                self.echoed.add(completion.index)
                choice = self._choice(completion.index, text, logprobs, None)
                result.append(self._chunk([choice]))
            if completion.finish_reason and completion.index not in self.terminated:
                self.terminated.add(completion.index)
                choice = self._choice(completion.index, "", None, completion.finish_reason)
                if self.want_prompt_logprobs:
                    choice["prompt_logprobs"] = self.logprobs.prompt_logprobs(output)
                result.append(self._chunk([choice]))
        return result

    def cut(self, finish_reason: str, num_choices: int) -> list[dict]:
        """Terminal chunks for the choices a cut stream left unfinished."""
        missing = [i for i in range(num_choices) if i not in self.terminated]
        self.terminated.update(missing)
        return [self._chunk([self._choice(i, "", None, finish_reason)]) for i in missing]

    def usage_chunk(self, output: RequestOutput) -> dict:
        """The final chunk with empty ``choices`` and the usage."""
        return self._chunk([], usage(output))

    def response(self, output: RequestOutput) -> dict:
        """The non-streamed ``text_completion`` body."""
        choices = []
        for c in output.outputs:
            text = (self.prompt_text if self.echo else "") + c.text
            logprobs = None
            if self.num_logprobs is not None:
                records, num_echo = self._records(output, c, c.logprobs or [])
                logprobs = self.logprobs.build(output, c.index, records, num_echo, len(text))
            choice = self._choice(c.index, text, logprobs, c.finish_reason)
            if self.want_prompt_logprobs:
                choice["prompt_logprobs"] = self.logprobs.prompt_logprobs(output)
            choices.append(choice)
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": usage(output),
        }


def _echo_text(ctx: ServerContext, prompt: str | list[int], skip_special: bool) -> str:
    """The prompt as echoed: the text as given, or the ids' text up to their last complete
    character (an unfinished one is completed by the output's text)."""
    if isinstance(prompt, str):
        return prompt
    end = len(prompt) - unfinished_tail(ctx.tokenizer, prompt, skip_special)
    return ctx.tokenizer.decode(prompt[:end], skip_special_tokens=skip_special)


async def create_completion(
    ctx: ServerContext, body: CompletionRequest, http_request: Request
) -> Response:
    """Serve one completion request (streamed or not)."""
    ctx.check_model(body.model)
    ctx.check_available()
    headers = response_headers(body)
    timer = ctx.metrics.timer()  # observed only once the request is admitted
    prompt = _single_prompt(body)
    if isinstance(prompt, str):
        ctx.check_prompt_chars(len(prompt), "prompt")
    try:
        prompt_ids = await asyncio.to_thread(encode_prompt, ctx.tokenizer, prompt)
    except ValueError as exc:
        raise invalid_request(exc) from None
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    params = sampling_params(ctx, body, max_tokens, body.logprobs, _num_prompt_logprobs(body))
    request_id = new_id("cmpl")
    ctx.mark_fault(request_id, [prompt] if isinstance(prompt, str) else [])
    stream = await start_request(ctx, request_id, prompt_ids, params, body)
    prompt_text = _echo_text(ctx, prompt, params.skip_special_tokens) if body.echo else ""
    formatter = CompletionFormatter(ctx, request_id, body, prompt_text, isinstance(prompt, str))
    if body.stream:
        usage_chunk = formatter.usage_chunk if body.include_usage else None

        def cut(reason: str) -> list[dict]:
            return formatter.cut(reason, params.n)

        events = sse_stream(ctx, stream, timer, [], formatter.chunks, usage_chunk, cut)
        return streaming_response(ctx, events, stream, headers)
    output = await run_to_end(ctx, http_request, stream, timer)
    if output is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(formatter.response(output), headers=headers)
