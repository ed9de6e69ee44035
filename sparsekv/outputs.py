"""Results returned to users: ``RequestOutput`` with one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVStats:
    """KV footprint of one request at its end, per token (averaged over layers).

    The figures are per token of the request, averaged over the model's layers (each layer
    caches its own K/V, so a full cache holds ``num_tokens`` slots in every layer): a
    29-token request on 30 layers with nothing removed reports 29 kept of 29.

    Attributes:
        kept_per_layer: slots held per layer (KV heads of a layer always hold the same count).
        evicted_per_layer: tokens removed per layer by compression so far (a sliding-window
            layer dropping pages past its window removes nothing by compression).
        num_tokens: logical tokens of the request whose K/V were computed.
    """

    kept_per_layer: list[int]
    evicted_per_layer: list[int]
    num_tokens: int

    @property
    def tokens_kept(self) -> float:
        """Slots held, averaged over layers (compression and sliding windows both lower it)."""
        layers = len(self.kept_per_layer)
        return 0.0 if layers == 0 else sum(self.kept_per_layer) / layers

    @property
    def tokens_full(self) -> int:
        """Slots a full cache holds in each layer: the request's tokens."""
        return self.num_tokens if self.kept_per_layer else 0

    @property
    def compression_ratio(self) -> float:
        """Fraction of the full cache removed by compression: ``sum(evicted) / (num_layers *
        num_tokens)``; 0 without compression, whatever the model's sliding windows drop."""
        full = len(self.evicted_per_layer) * self.num_tokens
        return 0.0 if full == 0 else min(1.0, sum(self.evicted_per_layer) / full)

    @property
    def window_ratio(self) -> float:
        """Fraction of the full cache the model's sliding-window layers no longer hold:
        ``1 - tokens_kept / tokens_full - compression_ratio`` (0 for models without them)."""
        full = len(self.kept_per_layer) * self.tokens_full
        if full == 0:
            return 0.0
        # In whole slots, so that a model without windows reports exactly 0.
        dropped = full - sum(self.kept_per_layer) - sum(self.evicted_per_layer)
        return max(0, dropped) / full


@dataclass
class Logprob:
    """Log-probability of one token, with the top alternatives at that position.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log) under the raw model distribution
            (``log_softmax`` of the logits, before penalties and temperature).
        top: ``(token_id, logprob)`` pairs, most likely first (length = requested top-N).
        rank: the token's rank in the distribution (1 = most likely); set for prompt
            logprobs only.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


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
        prompt_logprobs: when ``SamplingParams.prompt_logprobs`` was set, one entry per prompt
            token: ``None`` for the first, then the token's ``Logprob`` given the tokens
            before it (filled as the prefill runs).
        num_cached_tokens: prompt tokens served from the prefix cache instead of computed
            (whole pages, never the last prompt token; under ``scope: context``, the shared
            compressed context's tokens on a context hit), counted once per request: its
            first sample's hit when first admitted (the other samples of ``n > 1`` take that
            sample's pages). 0 with prefix caching off, and before the request is admitted.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    kv_stats: KVStats | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[Logprob | None] | None = None
    num_cached_tokens: int = 0
