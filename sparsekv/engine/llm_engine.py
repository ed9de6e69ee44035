"""The synchronous engine: add requests, abort them, and run steps.

``step()`` = schedule -> execute -> commit -> append tokens and detokenize -> outputs. An
exception inside a step fails only that step's requests (their pages are freed) and the engine
goes on. A request's checks and per-sample ``Request`` objects come from ``engine.admission``;
what a step appends and what a finished request reports, from ``engine.step_results``.
"""

from __future__ import annotations

import logging
import time

from sparsekv.config import CompressionConfig, EngineConfig, SpeculativeConfig
from sparsekv.engine import admission, step_results
from sparsekv.engine import output_processor as op
from sparsekv.engine.config_summary import engine_summary
from sparsekv.engine.detokenizer import IncrementalDetokenizer
from sparsekv.engine.engine_setup import EngineParts, build_engine_parts
from sparsekv.engine.stats import EngineStats
from sparsekv.kv_cache.policy import resolve_policy
from sparsekv.kv_cache.policy_settings import check_head_budget_method, merge_settings
from sparsekv.outputs import RequestOutput
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
        check_head_budget_method(config.compression)
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
        # One line of what the flags resolved to, so users can check they took effect.
        logger.info("%s", engine_summary(config, parts))

    # ----------------------------------------------------------------- requests
    def resolve_compression(
        self, compression: CompressionConfig | dict | None
    ) -> CompressionConfig | None:
        """A request's settings merged over the engine default (``kv_cache.policy.merge_settings``).

        Raises:
            ValueError: an unknown field or an invalid merged policy.
        """
        return merge_settings(self.config.compression, compression)

    def resolve_speculative(self, overrides: dict | None) -> SpeculativeConfig | None:
        """Merge a request's ``speculative`` fields over the engine's settings.

        Returns:
            The request's settings, or ``None`` when it decodes one token per step.

        Raises:
            ValueError: an unknown field, an invalid merged setting, a field the request's
                method never reads (``SpeculativeConfig.check_request_fields``), or
                speculation over int4 pages.
        """
        return admission.resolve_speculative(
            self.config.speculative, overrides, self.kv.kv_cache_dtype
        )

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

        ``params.max_tokens`` None is resolved here (``policy.implicit_max_tokens``).

        Raises:
            ValueError: invalid parameters, an empty or out-of-vocabulary prompt, ``n`` over
                ``max_num_seqs``, or (``PoolTooSmallError``) a request whose peak footprint
                exceeds the whole pool.
            ContextLengthError: (a ``ValueError``) a prompt of at least ``max_model_len``
                tokens, or the prompt plus ``max_tokens`` over it.
        """
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        num_prompt = len(prompt_token_ids)
        admission.check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        admission.check_sampling_params(
            params, num_prompt, self.max_model_len, self.vocab_size,
            self.config.scheduler.max_num_seqs,
        )  # fmt: skip
        speculative = self.resolve_speculative(params.speculative)
        draft_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        params = admission.with_max_tokens(
            params, self.config, compression, self.kv, num_prompt, self.max_model_len,
            draft_tokens, self.tokenizer,
        )  # fmt: skip
        policy = resolve_policy(
            self.config,
            compression,
            self.kv,
            num_prompt,
            params.max_tokens,
            draft_tokens,
            self.tokenizer,
        )
        # Prompt logprobs need every context row computed: no shared context.
        context_key = None
        if params.prompt_logprobs is None:
            context_key = policy.context_key(prompt_token_ids)
        samples = []
        for index in range(params.n):
            sample_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = admission.make_request(
                sample_id, prompt_token_ids, params, policy, index, forced_token_ids,
                self.eos_token_ids, self.parts.runner.device, self.config.model.seed,
            )  # fmt: skip
            request.collect_logits = collect_logits
            request.speculative = speculative
            request.context_key = context_key
            self.kv.register(sample_id, list(policy.layer_budgets), policy.kv)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            logprobs = [] if params.logprobs is not None else None
            samples.append(op.SampleState(request, detok, logprobs))
            self._sample_owner[sample_id] = request_id
        if params.n > 1 and self.scheduler.shares_prompt(samples[0].request):
            for state in samples[1:]:
                state.request.prefill_leader = samples[0].request
        group = op.RequestGroup(request_id, list(prompt_token_ids), samples)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first prompt token has no context
        self._groups[request_id] = group
        for state in samples:
            self.scheduler.add(state.request)
        # Once per request whatever its n, as usage.prompt_tokens counts it.
        self.stats.num_prompt_tokens += num_prompt

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

    def check_health(self) -> None:
        """Between steps: let the runner notice a failed tensor-parallel rank
        (``fatal_error`` is set then); a no-op for one process."""
        check = getattr(self.runner, "check_workers", None)
        if check is not None:
            check()

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
        start, drafted_before = time.perf_counter(), scheduled.draft_seconds
        try:
            result = self.runner.execute(scheduled)
        except Exception as exc:  # noqa: BLE001 - a failing step must not kill the engine
            logger.exception("engine step failed")
            return self._fail_step(scheduled, exc)
        # After the step: a self-drafting model proposes its drafts inside it.
        self.stats.spec_decode.draft_seconds += scheduled.draft_seconds
        if result.verified:  # the step's time less the drafts a self-drafting model made in it
            drafted_inside = scheduled.draft_seconds - drafted_before
            elapsed = time.perf_counter() - start - drafted_inside
            self.stats.spec_decode.count_step(result.verified, elapsed)
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
            reason = step_results.append_step_tokens(state, result, self.max_model_len, self.stats)
            if reason is not None:
                if reason == "length" or request.stop_reason is None:
                    op.flush(state)
                self._finish(state, reason)
            group.first_token_time = group.first_token_time or now
            group.last_token_time = now
            touched[group.request_id] = group
        return self._emit(touched)

    def _finish(self, state: op.SampleState, reason: str) -> None:
        request = state.request
        request_kv = self.kv.get(request.request_id) if self.kv.has(request.request_id) else None
        if request_kv is not None:
            state.kv_stats = step_results.finished_kv_stats(request, request_kv)
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
        pages past their window do not count): ``pages_used``, ``pages_total``,
        ``compression_ratio``."""
        return step_results.kv_usage(self.scheduler.running, self.kv)
