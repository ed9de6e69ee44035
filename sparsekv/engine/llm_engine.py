"""The synchronous engine: add requests, abort them, and run steps.

``step()`` = schedule -> execute -> commit -> append tokens and detokenize -> outputs. An
exception inside a step fails only that step's requests (their pages are freed) and the engine
goes on.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array

import torch

from sparsekv.config import CompressionConfig, EngineConfig, SpeculativeConfig
from sparsekv.engine import output_processor as op
from sparsekv.engine.detokenizer import IncrementalDetokenizer
from sparsekv.engine.engine_setup import EngineParts, build_engine_parts
from sparsekv.engine.request import Request
from sparsekv.engine.stats import EngineStats
from sparsekv.kv_cache.budget import layer_budgets
from sparsekv.kv_cache.manager import KVPolicy
from sparsekv.outputs import KVStats, RequestOutput
from sparsekv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a paged, layer-wise compressed KV cache.

    Args:
        config: validated engine configuration.
        parts: prebuilt model, tokenizer and KV manager (tests); built from ``config`` if None.
    """

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        config.validate()
        self.config = config
        parts = parts or build_engine_parts(config)
        self.parts = parts
        self.tokenizer = parts.tokenizer
        self.model_name = parts.model_name
        self.max_model_len = parts.max_model_len
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.eos_token_ids = parts.eos_token_ids
        self.vocab_size = parts.vocab_size
        self.stats = EngineStats()
        self._groups: dict[str, op.RequestGroup] = {}
        self._sample_owner: dict[str, str] = {}

    # ----------------------------------------------------------------- requests
    def resolve_compression(
        self, compression: CompressionConfig | dict | None
    ) -> CompressionConfig | None:
        """Merge a per-request policy over the engine default, field by field (budget
        and ratio are one choice: giving either replaces the other).

        Raises:
            ValueError: an unknown field or an invalid merged policy.
        """
        base = self.config.compression
        if compression is None:
            policy = base
        elif isinstance(compression, CompressionConfig):
            compression.validate()
            policy = compression
        else:
            policy = base.merged(dict(compression))
        return policy if policy.enabled else None

    def resolve_speculative(self, overrides: dict | None) -> SpeculativeConfig | None:
        """Merge a request's ``speculative`` fields over the engine's settings.

        Returns:
            The request's settings, or ``None`` when it decodes one token per step.

        Raises:
            ValueError: an unknown field, an invalid merged setting, or speculation over int4
                pages.
        """
        base = self.config.speculative
        spec = base if overrides is None else base.merged(dict(overrides))
        if not spec.enabled:
            return None
        if self.kv.kv_cache_dtype == "int4":
            raise ValueError("speculative: int4 pages cannot roll draft tokens back")
        return spec

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compression: CompressionConfig | dict | None = None,
        forced_token_ids: list[int] | None = None,
        collect_logits: bool = False,
    ) -> None:
        """Queue a request (``n`` samples become ``n`` sequences).

        Args:
            request_id: unique id of the request.
            prompt_token_ids: the tokenized prompt.
            params: sampling parameters (validated here).
            compression: per-request policy override (object or field dict), or None.
            forced_token_ids: teacher forcing; sampled tokens are replaced by these.
            collect_logits: keep fp32 logits of every sampled position (fidelity metric).

        Raises:
            ValueError: invalid parameters, an empty or out-of-vocabulary prompt, a prompt over
                the context, or a request whose peak footprint exceeds the whole pool.
        """
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self._check_prompt(prompt_token_ids)
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stops:
            raise ValueError(
                f"stop_token_ids: token id {bad_stops[0]} is outside [0, {self.vocab_size})"
            )
        params.validate(max_model_len=self.max_model_len, num_prompt_tokens=len(prompt_token_ids))
        policy = self.resolve_compression(compression)
        speculative = self.resolve_speculative(params.speculative)
        num_prompt = len(prompt_token_ids)
        context_len = _context_len(policy, num_prompt)
        budgets = self._budgets(policy, num_prompt if context_len is None else context_len)
        if all(b is None for b in budgets):
            policy = context_len = None
        kv_policy = KVPolicy(
            decode_eviction=policy.decode_eviction if policy else True,
            bounded_chunks=policy is not None and policy.chunked_mode == "bounded",
        )
        compressed_len, later_tokens = num_prompt, params.max_tokens
        if context_len is not None:
            # Compressed once at the end of the context; the question and output stay whole.
            kv_policy = KVPolicy(decode_eviction=False, bounded_chunks=False, context_only=True)
            compressed_len, later_tokens = context_len, params.max_tokens + num_prompt - context_len
        if speculative is not None:
            # A verification step holds the slots of its draft tokens until it commits.
            later_tokens += speculative.num_speculative_tokens
        peaks = self.kv.peak_pages(budgets, compressed_len, later_tokens, kv_policy)
        for peak, size in zip(peaks, self.kv.pool.kind_sizes):
            if peak > size:
                raise ValueError(
                    f"max_tokens: the request needs {peak} KV pages at its peak but the pool "
                    f"has {size}; shorten the prompt or max_tokens, or raise --kv-cache-memory"
                )
        samples = []
        for index in range(params.n):
            sample_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = self._make_request(
                sample_id, prompt_token_ids, params, policy, index, forced_token_ids
            )
            request.collect_logits = collect_logits
            request.speculative = speculative
            if context_len is not None:
                request.context_len = context_len
                # Prompt logprobs need every context row computed: no shared context.
                if params.prompt_logprobs is None:
                    key = _context_key(policy, budgets, prompt_token_ids, context_len)
                    request.context_key = key
            self.kv.register(sample_id, budgets, kv_policy)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            logprobs = [] if params.logprobs is not None else None
            samples.append(op.SampleState(request, detok, logprobs))
            self._sample_owner[sample_id] = request_id
        group = op.RequestGroup(request_id, list(prompt_token_ids), samples)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first prompt token has no context
        self._groups[request_id] = group
        for state in samples:
            self.scheduler.add(state.request)
        self.stats.num_prompt_tokens += len(prompt_token_ids) * params.n

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room in the context of "
                f"{self.max_model_len} tokens"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside [0, {self.vocab_size})")

    def _budgets(self, policy: CompressionConfig | None, num_prompt: int) -> list[int | None]:
        specs = self.kv.layer_specs
        if policy is None:
            return [None] * len(specs)
        compressible = [spec.compressible for spec in specs]
        return layer_budgets(policy, len(specs), num_prompt, compressible)

    def _make_request(
        self,
        sample_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        policy: CompressionConfig | None,
        index: int,
        forced_token_ids: list[int] | None,
    ) -> Request:
        from sparsekv.compression.registry import get_compressor

        generator = None
        if params.seed is not None:
            # On the engine's device: a seeded row draws its uniforms where the logits are.
            device = self.parts.runner.device
            generator = torch.Generator(device=device).manual_seed(params.seed + index)
        kv_generator = torch.Generator().manual_seed(
            (params.seed if params.seed is not None else self.config.model.seed) + index
        )
        compressor = get_compressor(policy) if policy is not None else None
        if compressor is not None and compressor.reconstructs:
            if self.config.parallel.tensor_parallel_size > 1:
                raise ValueError(
                    f"kv_compression: {compressor.name} is not supported with tensor "
                    "parallelism (the step plan carries no reconstruction rows)"
                )
        if compressor is not None and self.tokenizer is not None:
            compressor.bind(self.tokenizer)
        return Request(
            request_id=sample_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            compression=policy,
            eos_token_ids=self.eos_token_ids,
            generator=generator,
            forced_token_ids=forced_token_ids,
            compressor=compressor,
            kv_generator=kv_generator,
            sample_index=index,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; returns its final output (or None)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for state in group.samples:
            request = state.request
            self._sample_owner.pop(request.request_id, None)
            if not request.is_finished:
                self._finish(state, "abort")
        self.stats.num_aborted += 1
        return op.build_output(group)

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank failed), else
        ``None``; every step's requests then fail with this error."""
        return getattr(self.runner, "fatal_error", None)

    def shutdown(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks); a no-op for one process."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Run one engine step and return outputs of requests that progressed or finished."""
        scheduled = self.scheduler.schedule()
        self.stats.num_preemptions += len(scheduled.preempted_ids)
        self.stats.count_prefix_lookups(scheduled.prefix_hits)
        if scheduled.is_empty:
            return []
        start = time.perf_counter()
        try:
            result = self.runner.execute(scheduled)
        except Exception as exc:  # noqa: BLE001 - a failing step must not kill the engine
            logger.exception("engine step failed")
            return self._fail_step(scheduled, exc)
        # After the step: a self-drafting model proposes its drafts inside it.
        self.stats.spec_decode.draft_seconds += scheduled.draft_seconds
        if result.verified:
            self.stats.spec_decode.count_step(result.verified, time.perf_counter() - start)
        self.scheduler.update(scheduled)
        now = time.monotonic()
        touched: dict[str, op.RequestGroup] = {}
        for item in scheduled.scheduled:
            request = item.request
            owner = self._sample_owner.get(request.request_id)
            group = self._groups.get(owner) if owner is not None else None
            if group is None:
                continue
            chunk = result.prompt_logprobs.get(request.request_id)
            if chunk is not None and request.sample_index == 0:
                op.add_prompt_logprobs(group, *chunk)
            if not item.samples:
                continue
            state = group.samples[request.sample_index]
            if request.sampling_params.max_tokens == 0:  # prefill only: nothing is appended
                self._finish(state, "length")
                touched[group.request_id] = group
                continue
            reason = self._append_tokens(state, result)
            if reason is not None:
                if reason == "length" or request.stop_reason is None:
                    op.flush(state)
                self._finish(state, reason)
            group.first_token_time = group.first_token_time or now
            group.last_token_time = now
            touched[group.request_id] = group
        return self._emit(touched)

    def _append_tokens(self, state: op.SampleState, result) -> str | None:
        """Append the step's token (or a verifying request's accepted tokens, up to the first
        that finishes it); returns the finish reason or ``None``."""
        request = state.request
        verified = result.verified.get(request.request_id)
        if verified is not None:
            logprobs = verified.logprobs or [None] * len(verified.token_ids)
            for token, logprob in zip(verified.token_ids, logprobs):
                reason = op.append_token(state, token, logprob, self.max_model_len)
                self.stats.num_generation_tokens += 1
                if reason is not None:
                    return reason
            return None
        token = result.token_ids[request.request_id]
        if request.forced_token_ids is not None:
            forced = request.forced_token_ids
            token = forced[min(request.num_output_tokens, len(forced) - 1)]
        if request.request_id in result.logits:
            request.logits.append(result.logits[request.request_id])
        logprob = result.logprobs.get(request.request_id)
        self.stats.num_generation_tokens += 1
        return op.append_token(state, token, logprob, self.max_model_len)

    def _finish(self, state: op.SampleState, reason: str) -> None:
        request = state.request
        request_kv = self.kv.get(request.request_id) if self.kv.has(request.request_id) else None
        if request_kv is not None:
            state.kv_stats = KVStats(
                kept_per_layer=request_kv.kept_per_layer(),
                evicted_per_layer=request_kv.evicted_per_layer(),
                # Tokens whose K/V were computed: the last sampled token never enters the
                # cache, so an uncompressed request reports a ratio of exactly 0.
                num_tokens=request.num_computed_tokens,
            )
            self.stats.num_evicted_tokens += sum(request_kv.evicted_per_layer())
            # Never after an abort or a failed step.
            if reason in ("stop", "length") and self.kv.prefix_cache is not None:
                tokens = op.cacheable_token_ids(state, self.tokenizer, self.kv.block_size)
                self.kv.cache_computed(request.request_id, tokens)
        self.scheduler.finish(request, reason)

    def _emit(self, touched: dict[str, op.RequestGroup]) -> list[RequestOutput]:
        outputs = []
        for request_id, group in touched.items():
            outputs.append(op.build_output(group))
            if group.finished:
                self._forget(request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is not None:
            for state in group.samples:
                self._sample_owner.pop(state.request.request_id, None)

    def _fail_step(self, scheduled, exc: Exception) -> list[RequestOutput]:
        touched: dict[str, op.RequestGroup] = {}
        for item in scheduled.scheduled:
            owner = self._sample_owner.get(item.request.request_id)
            group = self._groups.get(owner) if owner is not None else None
            if group is None:
                continue
            group.error = f"engine step failed: {type(exc).__name__}: {exc}"
            touched[group.request_id] = group
        for group in touched.values():
            for state in group.samples:
                if not state.request.is_finished:
                    self._finish(state, "error")
        return self._emit(touched)

    def kv_usage(self) -> dict[str, float]:
        """Pool occupancy and the fraction of the running requests' full caches removed by
        compression (slots evicted over ``num_layers * tokens``; sliding-window layers dropping
        pages past their window do not count)."""
        evicted = full = 0
        for request in self.scheduler.running:
            if self.kv.has(request.request_id):
                request_kv = self.kv.get(request.request_id)
                evicted += sum(request_kv.evicted_per_layer())
                full += len(request_kv.layers) * request.num_computed_tokens
        return {
            "pages_used": self.kv.num_total_pages - self.kv.num_free_pages,
            "pages_total": self.kv.num_total_pages,
            "compression_ratio": 0.0 if full == 0 else min(1.0, evicted / full),
        }


def _context_len(policy: CompressionConfig | None, num_prompt: int) -> int | None:
    """The shared context's length for scope ``context`` (else ``None``).

    Raises:
        ValueError: scope ``context`` without ``context_tokens``, or more context than prompt.
    """
    if policy is None or policy.scope != "context":
        return None
    if policy.context_tokens is None:
        raise ValueError(
            "kv_compression.context_tokens: scope 'context' needs the context length (chat "
            "requests get it from the messages before the last user message)"
        )
    if policy.context_tokens > num_prompt:
        raise ValueError(
            f"kv_compression.context_tokens: {policy.context_tokens} exceeds the prompt's "
            f"{num_prompt} tokens"
        )
    return policy.context_tokens


def _context_key(
    policy: CompressionConfig, budgets: list[int | None], token_ids: list[int], context_len: int
) -> bytes | None:
    """Key of a compressed context: its tokens, the per-layer budgets and every setting that
    changes which tokens are kept. ``None`` (never shared) for the seeded ``random`` method and
    for a context that is the whole prompt (the last prompt token must run to sample)."""
    if policy.method == "random" or context_len >= len(token_ids):
        return None
    settings = (
        policy.method,
        tuple(budgets),
        policy.window,
        policy.pooling,
        policy.kernel_size,
        policy.gqa_agg,
        policy.chunked_mode,
    )
    hasher = hashlib.blake2b(repr(settings).encode(), digest_size=16)
    hasher.update(array("q", token_ids[:context_len]).tobytes())
    return b"context:" + hasher.digest()
