"""Results returned to users: ``RequestOutput`` with one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVStats:
    """KV footprint of one request at its end.

    Attributes:
        kept_per_layer: slots held per layer (KV heads of a layer always hold the same count).
        evicted_per_layer: tokens removed per layer by compression so far.
        num_tokens: logical tokens of the request (prompt + generated).
        compression_ratio: effective ratio ``1 - sum(kept) / (num_layers * num_tokens)``.
    """

    kept_per_layer: list[int]
    evicted_per_layer: list[int]
    num_tokens: int

    @property
    def tokens_kept(self) -> int:
        return sum(self.kept_per_layer)

    @property
    def tokens_full(self) -> int:
        return len(self.kept_per_layer) * self.num_tokens

    @property
    def compression_ratio(self) -> float:
        full = self.tokens_full
        return 0.0 if full == 0 else 1.0 - self.tokens_kept / full


@dataclass
class Logprob:
    """Log-probability of one token, with the top alternatives at that position.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log) under the raw model distribution
            (``log_softmax`` of the logits, before penalties and temperature).
        top: ``(token_id, logprob)`` pairs, most likely first (length = requested top-N).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: detokenized output (stop string excluded unless asked).
        token_ids: generated token ids.
        finish_reason: ``None`` while running, then ``stop``, ``length``, ``abort`` or ``error``.
        stop_reason: the stop string or token id that ended it, if any.
        logprobs: one entry per generated token when logprobs were requested.
        delta_text: text added since the previous output (streaming).
        num_delta_tokens: token ids added since the previous output.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None
    delta_text: str = ""
    num_delta_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything a request produced so far.

    Attributes:
        request_id: caller's id.
        prompt_token_ids: the prompt as tokenized (chat template applied).
        outputs: one ``CompletionOutput`` per sample.
        finished: all samples finished.
        kv_stats: KV footprint per sample at the latest step (``None`` before prefill).
        error: message when the request failed inside the engine.
        metrics: timestamps in seconds (``arrival``, ``first_token``, ``last_token``).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    kv_stats: KVStats | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
