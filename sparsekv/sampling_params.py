"""Per-request sampling settings (OpenAI / vLLM semantics), validated once at arrival."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sparsekv.errors import ContextLengthError

MAX_LOGPROBS = 20
# Stop strings a request may give, and characters per string: every generated token is
# checked against each, so 100000 strings cost ~0.1 s a token of the engine's step (OpenAI
# takes 4).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
# Temperatures below this are treated as greedy: dividing logits by them overflows fp32.
GREEDY_TEMPERATURE = 1e-5
# Accepted repetition penalties (see _validate_penalties).
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Attributes:
        n: number of independent samples of the prompt.
        temperature: softmax temperature; ``0`` (or below 1e-5) means greedy decoding.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
            sums to at least ``top_p``; ``1`` is off.
        top_k: keep the ``top_k`` most likely tokens; ``0`` or ``-1`` is off.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's; ``0`` is off.
        repetition_penalty: CTRL/HF penalty on every token of the prompt and output: positive
            logits are divided by it, negative ones multiplied; ``1`` is off; in [1e-4, 1e4].
        presence_penalty: OpenAI penalty subtracted once from every token already generated.
        frequency_penalty: OpenAI penalty subtracted per occurrence of a generated token.
        seed: seeds the request's own random generator, so its random draws do not depend
            on the batch, on other requests or on preemption; ``None`` uses the engine's
            generator. The tokens repeat exactly where the logits do: in fp32 with
            full-precision KV pages, in any batch, after preemption and on a prefix-cache
            hit. In bf16 (the default dtype where the CPU has native bf16) a batch or a
            prefix-cache hit rounds the logits differently, and so does a prefix-cache hit or
            a chunked prefill over int8 / fp8 / int4 KV pages, so a draw near a boundary can
            differ and the text diverge from there.
        stop: strings that end generation; the text is cut before the match (a ``str`` is
            accepted and becomes a one-element list).
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS.
        max_tokens: most tokens to generate; ``0`` runs only the prefill (for
            ``prompt_logprobs``) and generates nothing; ``None``: up to the end of the context,
            or fewer where the KV pool could not hold that many (set when the request is
            added, ``LLMEngine.add_request``).
        min_tokens: EOS, ``stop_token_ids`` and stop strings are ignored until this many tokens
            were generated.
        logprobs: ``None`` for none; else the log-probability of each sampled token plus the
            ``logprobs`` (0-20) most likely alternatives.
        prompt_logprobs: ``None`` for none; else the log-probability of every prompt token
            after the first, given the tokens before it, plus the ``prompt_logprobs`` (0-20)
            most likely alternatives at each position. Computed during the prefill; with
            ``kv_compression.scope = "context"`` the positions after the context see the
            compressed context, otherwise every position sees the whole prompt (compression
            runs at the end of the prompt). A request asking for them gets no prefix-cache hit.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: leave special tokens out of the text.
        speculative: per-request speculative decoding settings over the engine's, field by
            field (``SpeculativeConfig``: ``method``, ``num_speculative_tokens``,
            ``ngram_prompt_lookup_min``, ``ngram_prompt_lookup_max``, ``draft_sink_tokens``,
            ``draft_recent_tokens``, ``draft_vocab_size``); ``{"method": None}`` or
            ``{"num_speculative_tokens": 0}`` opts out, ``{"method": "ngram"}`` or
            ``{"method": "sparse_self"}`` opts in on an engine started without speculation.
            ``None``: the engine's settings.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: dict | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif _is_collection(self.stop):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not _is_collection(self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax of the (penalized) logits."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(
        self, max_model_len: int | None = None, num_prompt_tokens: int | None = None
    ) -> None:
        """Checks every field once, at arrival.

        Args:
            max_model_len: context length in tokens; with ``num_prompt_tokens`` the request
                must fit (prompt + max_tokens <= max_model_len).
            num_prompt_tokens: length of the templated prompt in tokens.

        Raises:
            ValueError: message starts with the offending parameter's name;
                ``ContextLengthError`` (a ``ValueError``) when the prompt plus ``max_tokens``
                exceeds ``max_model_len``.
        """
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()
        self._validate_length(max_model_len, num_prompt_tokens)

    def _validate_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        # None: up to the end of the context; the engine sets it when the request is added.
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if self.speculative is not None and not isinstance(self.speculative, dict):
            raise ValueError(f"speculative must be an object, got {self.speculative!r}")

    def _validate_distribution(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _validate_penalties(self) -> None:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
        # Logits are divided (or multiplied) by it in fp32: far outside this range they
        # overflow to inf or underflow to 0, and the softmax turns them into NaN.
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(
                f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty!r}"
            )
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"
            )

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got "
                    f"{len(s)}"
                )
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold token ids >= 0, got {t!r}")

    def _validate_length(self, max_model_len: int | None, num_prompt_tokens: int | None) -> None:
        if max_model_len is None or self.max_tokens is None:
            return
        num_prompt = num_prompt_tokens or 0
        if num_prompt + self.max_tokens > max_model_len:
            raise ContextLengthError(
                f"max_tokens ({self.max_tokens}) plus the prompt's {num_prompt} tokens "
                f"= {num_prompt + self.max_tokens} exceeds max_model_len ({max_model_len})"
            )


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_collection(x: object) -> bool:
    """A list-like of items: not a string, bytes or mapping (whose iteration is no list)."""
    return isinstance(x, Iterable) and not isinstance(x, str | bytes | Mapping)
