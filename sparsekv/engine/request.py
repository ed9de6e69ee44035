"""A request as the scheduler sees it: token ids and counters (counters, not phases: the
scheduler closes the gap between computed and total tokens, whatever the request is doing)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from sparsekv.compression.base import Compressor
from sparsekv.config import CompressionConfig, SpeculativeConfig
from sparsekv.kv_cache.policy import CompressionPolicy
from sparsekv.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique id (a sample of an ``n > 1`` request has its own id).
        prompt_token_ids: the prompt.
        sampling_params: how to sample.
        policy: the request's compression, resolved once at admission (settings, compressor,
            budgets, capabilities); ``None``: a full cache (requests built outside the engine).
        output_token_ids: generated so far.
        num_computed_tokens: tokens whose K/V are in the cache (or were scored and evicted).
        generator: per-request RNG when a seed is given (survives preemption).
        num_preemptions: preemptions in a row without progress (at 3, the oldest
            request is not preempted again).
        forced_token_ids: teacher forcing: tokens appended instead of sampled ones (fidelity).
        collect_logits: keep each sampled position's fp32 logits in ``logits`` (fidelity).
        kv_generator: random source of compressors that evict randomly.
        sample_index: index of this sample within its ``n > 1`` parent request.
        context_key: key of the compressed context shared between requests with the same
            context tokens and policy (``None``: not shared).
        speculative: the request's resolved speculative decoding settings (``None``: it
            decodes one token per step).
        prefill_leader: the first sample of this ``n > 1`` request, whose prompt pages this
            sample takes from the prefix cache once they are computed; cleared when the
            sample is admitted (``None``: it prefills its own prompt).
        num_cached_tokens: prompt tokens served from the prefix cache (or a shared compressed
            context) when the request was first admitted; ``None`` before that or where no
            lookup ran (prefix caching off). Later admissions (after a preemption) keep it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    policy: CompressionPolicy | None = None
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    forced_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    collect_logits: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)
    kv_generator: torch.Generator | None = None
    sample_index: int = 0
    context_key: bytes | None = None
    speculative: SpeculativeConfig | None = None
    prefill_leader: Request | None = field(default=None, repr=False, compare=False)
    num_cached_tokens: int | None = None

    @property
    def compression(self) -> CompressionConfig | None:
        """The request's merged compression settings (``None`` = full cache)."""
        return self.policy.settings if self.policy is not None else None

    @property
    def compressor(self) -> Compressor | None:
        """The request's compressor, or ``None`` for a full cache."""
        return self.policy.compressor if self.policy is not None else None

    @compressor.setter
    def compressor(self, compressor: Compressor | None) -> None:
        # A tensor-parallel rank runs the same policy through its own wrapper.
        if compressor is not self.compressor:
            self.policy = (self.policy or CompressionPolicy()).with_compressor(compressor)

    @property
    def context_len(self) -> int | None:
        """``kv_compression.scope = "context"``: the prompt's first ``context_len`` tokens are
        the shared context, compressed once when their prefill completes (the prefill is cut
        there); the rest of the prompt and the output stay uncompressed. ``None``: the whole
        prompt is compressed at its end."""
        return self.policy.context_len if self.policy is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def compression_end(self) -> int:
        """Tokens whose prefill ends with the compression step (the context or the prompt)."""
        return self.context_len if self.context_len is not None else self.num_prompt_tokens

    def next_chunk(self, token_budget: int) -> int:
        """Tokens of the next step under ``token_budget``: a prefill chunk never crosses
        ``compression_end``, so compression runs exactly at the end of the context."""
        num_new = min(self.num_tokens - self.num_computed_tokens, token_budget)
        if self.num_computed_tokens < self.compression_end:
            num_new = min(num_new, self.compression_end - self.num_computed_tokens)
        return num_new

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_attention_mass(self) -> bool:
        """The compressor scores with every query's accumulated attention
        (``Compressor.needs_attention_mass``)."""
        return self.policy is not None and self.policy.needs_attention_mass

    def max_prefix_hit_tokens(self, may_compact: bool) -> int:
        """Most prompt tokens a prefix-cache hit may cover; the rest is recomputed.

        The last prompt token is always recomputed (it samples the first output). A request
        whose budgeted layers may compact (``may_compact``) recomputes its observation window
        too (its stored window queries and scores come only from computed rows); then a
        compressor that ``needs_attention_mass`` (the mass of every query) and bounded chunked
        compression (compacts after every chunk) get no hit; nor does a request that asks for
        prompt logprobs.
        """
        if self.sampling_params.prompt_logprobs is not None:
            return 0  # every prompt row must run to give its logprob
        policy = self.compression
        if policy is None or not may_compact:
            return self.num_prompt_tokens - 1
        if self.needs_attention_mass or policy.chunked_mode == "bounded":
            return 0
        return self.num_prompt_tokens - policy.window

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``start .. end - 1`` of prompt + output (``0 <= start <= end``), without
        copying the whole prompt (a decode step reads one token per request)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
