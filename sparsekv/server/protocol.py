"""Request bodies of the OpenAI-compatible API, with the sparsekv and vLLM extra fields.

Types are checked here, strictly as OpenAI's API does (pydantic strict mode, 400 on mismatch):
``"max_tokens": "4"`` or ``true`` is not an integer, ``"stream": "yes"`` is not a boolean, and
``Infinity``/``NaN`` are no numbers. Value rules live in ``SamplingParams`` and
``CompressionConfig`` so the offline and HTTP APIs share one validation. Fields the server
does not know are kept (``model_extra``), logged and listed in a response header.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from sparsekv.engine.prompts import CHAT_ROLES


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid Unicode (it holds a lone surrogate)") from None
    return text


# A string the tokenizer can take: JSON's \uD800-style escapes can smuggle in lone surrogates.
Text = Annotated[str, AfterValidator(_encodable)]

# Bounds that only keep huge integers from overflowing torch's int64 (ranges are checked by
# SamplingParams.validate, with its messages).
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=-(2**62), le=2**62)]
# Policy sizes: ranges are CompressionConfig.validate's; this only bounds absurd integers.
Size = Annotated[int, Field(lt=2**31)]


def _shown(value: Any) -> str:
    """A client's JSON value as it sent it, cut short, for an error message."""
    text = json.dumps(value, default=repr)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} (a boolean)" if isinstance(value, bool) else text


def _check_token_ids(prompt: Any) -> Any:
    """Reject a token-id prompt (a list, or a list of lists) holding anything but integers,
    naming the value and its place.

    Left to the union of prompt types, such a prompt is reported against its first branch
    ("Input should be a valid string"). Booleans are named explicitly: ``true`` is an ``int``
    in Python. A list of strings only is left to the union (a batch of text prompts).
    """
    if not isinstance(prompt, list):
        return prompt
    nested = bool(prompt) and all(isinstance(row, list) for row in prompt)
    rows = list(enumerate(prompt)) if nested else [(None, prompt)]
    for r, row in rows:
        if all(isinstance(token, str) for token in row):
            continue
        if any(isinstance(token, str) for token in row):
            where = "prompt" if r is None else f"prompt[{r}]"
            raise PydanticCustomError(
                "prompt_list_mixed",
                "a prompt list must hold only strings or only token ids, {where} mixes them",
                {"where": where},
            )
        for i, token in enumerate(row):
            if type(token) is not int:
                where = f"prompt[{i}]" if r is None else f"prompt[{r}][{i}]"
                raise PydanticCustomError(
                    "token_id_type",
                    "token ids must be integers, got {value} at {where}",
                    {"value": _shown(token), "where": where},
                )
    return prompt


class SpeculativeBody(BaseModel):
    """The ``speculative`` object: the request's speculative decoding settings over the
    server's (``method: null`` or ``num_speculative_tokens: 0`` opts out; ``method: "ngram"``
    or ``"sparse_self"`` opts in on a server started without speculation)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: str | None = None
    num_speculative_tokens: Size | None = None
    ngram_prompt_lookup_min: Size | None = None
    ngram_prompt_lookup_max: Size | None = None
    draft_sink_tokens: Size | None = None
    draft_recent_tokens: Size | None = None
    draft_vocab_size: Size | None = None

    def overrides(self) -> dict[str, Any]:
        """The fields the client gave; an explicit ``method: null`` is kept (opt-out)."""
        given = self.model_dump(exclude_unset=True)
        return {k: v for k, v in given.items() if v is not None or k == "method"}


class KVCompressionBody(BaseModel):
    """The ``kv_compression`` object: fields override the server's default policy one by one."""

    # Strict types: a budget of "64" or a decode_eviction of "yes" is a 400, not a guess.
    model_config = ConfigDict(extra="forbid", strict=True)

    method: str | None = None
    budget: Size | None = None
    compression_ratio: FiniteFloat | None = None
    window: Size | None = None
    pooling: str | None = None
    kernel_size: Size | None = None
    gqa_agg: str | None = None
    full_layers: Size | None = None
    layer_budgets: list[Size] | None = None
    layer_fractions: list[FiniteFloat] | None = None
    decode_eviction: bool | None = None
    chunked_mode: str | None = None
    scope: str | None = None
    context_tokens: Size | None = None
    head_budgets: str | None = None
    layer_scores: str | None = None

    def overrides(self) -> dict[str, Any]:
        """The fields the client gave (``null`` means "not given")."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a usage chunk before ``[DONE]``."""

    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingBody(BaseModel):
    """Fields shared by both endpoints (OpenAI names plus the sparsekv/vLLM extras)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = 1
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    max_tokens: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: FiniteFloat = 0.0
    frequency_penalty: FiniteFloat = 0.0
    seed: Seed | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    user: str | None = None
    # sparsekv / vLLM extras
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: Annotated[int, Field(lt=2**31)] = 0
    min_p: FiniteFloat = 0.0
    repetition_penalty: FiniteFloat = 1.0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    kv_compression: KVCompressionBody | None = None
    speculative: SpeculativeBody | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo):
        # OpenAI's API rejects stream options on a request that does not stream.
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields of the body that the server does not know (sorted)."""
        return sorted(self.model_extra or {})


class CompletionRequest(SamplingBody):
    """POST /v1/completions: text or token-id prompt; ``logprobs`` is the top-N count (0-20).

    ``echo`` prepends the prompt to the text (and, with ``logprobs``, the prompt tokens'
    logprobs, the first one ``null``); ``prompt_logprobs`` (vLLM) returns the prompt tokens'
    logprobs with their top-N in a separate ``prompt_logprobs`` list. ``max_tokens: 0``
    generates nothing (useful with either).
    """

    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None  # only best_of = n (the default) is served
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _integer_token_ids(cls, value: Any) -> Any:
        return _check_token_ids(value)


class TextPart(BaseModel):
    """One part of a multi-part message content; only text is supported."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    """One chat message (``content`` text or a list of text parts, required for every role)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal[CHAT_ROLES]
    # OpenAI allows a null (or absent) content only on an assistant message that carries
    # tool_calls, a function_call or a refusal instead. This server takes none of those (they
    # would be dropped, changing the conversation the model sees), so content is required and
    # null is a 400 for every role.
    content: Text | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:
            raise PydanticCustomError(
                "content_null",
                "must be a string or a list of text parts, not null (null content is only for "
                "assistant tool calls, which this server does not support)",
            )
        return value


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions: ``logprobs`` is a bool, ``top_logprobs`` the top-N count."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Accepted only where they ask for nothing the server does not do (see the validators);
    # then listed with the ignored fields.
    tool_choice: Any = None
    response_format: Any = None

    @field_validator("tool_choice")
    @classmethod
    def _no_forced_tool_call(cls, value: Any) -> Any:
        # "none" and "auto" leave the model free to answer in text, which is what it does; a
        # required or named tool call would be silently broken.
        if value is not None and value not in ("none", "auto"):
            raise ValueError("tool calls are not supported: only 'none' or 'auto' is accepted")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if value is not None and kind != "text":
            raise ValueError(
                "structured output (json_object, json_schema) is not supported: only "
                "{'type': 'text'} is accepted"
            )
        return value

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields the server does not know or does not act on (sorted)."""
        accepted = [n for n in ("tool_choice", "response_format") if getattr(self, n) is not None]
        return sorted([*(self.model_extra or {}), *accepted])
