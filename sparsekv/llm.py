"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams)``."""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Iterable, Mapping, Sequence

from tqdm import tqdm

from sparsekv.config import (
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
)
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.engine.prompts import Prompt, chat_context_tokens, encode_prompt
from sparsekv.outputs import RequestOutput
from sparsekv.sampling_params import SamplingParams


class LLM:
    """Generate offline with continuous batching over a sparse paged KV cache.

    Args:
        model: GGUF path, Hugging Face folder, or built-in name.
        dtype: ``auto``, ``bfloat16`` or ``float32``.
        kv_compression: default compression policy: ``None`` (snapkv, budget 1024, the first 2
            layers full), a ``CompressionConfig``, or a dict of ``CompressionConfig`` fields
            applied over that default (``{"method": "none"}`` = full cache,
            ``{"compression_ratio": 0.75}`` = keep 25% of each budgeted layer).
        kv_cache_memory: GiB for the page pool; ``None`` sizes it from the device (2 GiB
            on CPU, the free memory under ``gpu_memory_utilization`` on CUDA).
        speculative: speculative decoding: a ``SpeculativeConfig`` or a dict of its fields
            (``{"method": "ngram", "num_speculative_tokens": 4}``); ``None``: off.
        engine_config: a full ``EngineConfig`` (overrides the keyword settings).
        **kwargs: other ``ModelConfig``/``CacheConfig``/``SchedulerConfig``/``ParallelConfig``
            fields by name (``tensor_parallel_size=2``).

    Raises:
        ValueError: an invalid setting, or a missing or corrupt model file.
    """

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        dtype: str = "auto",
        kv_compression: CompressionConfig | dict | None = None,
        kv_cache_memory: float | None = None,
        engine_config: EngineConfig | None = None,
        speculative: SpeculativeConfig | dict | None = None,
        **kwargs,
    ) -> None:
        if engine_config is None:
            if isinstance(speculative, dict):
                speculative = SpeculativeConfig().merged(speculative)
            engine_config = EngineConfig(
                model=ModelConfig(model=model, dtype=dtype),
                cache=CacheConfig(kv_cache_memory=kv_cache_memory),
                compression=_default_policy(kv_compression),
                speculative=speculative or SpeculativeConfig(),
            )
            _apply_kwargs(engine_config, kwargs)
        self.engine = LLMEngine(engine_config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_compression: CompressionConfig | dict | Sequence | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        Args:
            prompts: one prompt or a list (text, token ids, or chat messages).
            sampling_params: one for all prompts or one per prompt (default:
                ``SamplingParams()``: temperature 1, 16 tokens).
            kv_compression: per-request policy: a ``CompressionConfig``, or a dict of its
                fields applied over the engine's default policy; one for all prompts or a list.
            use_tqdm: show a progress bar.

        Raises:
            ValueError: invalid input; nothing is queued in that case.
            RuntimeError: the engine cannot run any more (a tensor-parallel rank failed).
        """
        prompt_list = _as_prompt_list(prompts)
        params = _broadcast(
            sampling_params or SamplingParams(), len(prompt_list), "sampling_params"
        )
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(
                    "sampling_params: expected a SamplingParams (or a list of them, one per "
                    f"prompt), got {type(sp).__name__}"
                )
        policies = _broadcast(kv_compression, len(prompt_list), "kv_compression")
        for policy in policies:
            if policy is not None and not isinstance(policy, (dict, CompressionConfig)):
                raise ValueError(
                    "kv_compression: expected None, a dict of CompressionConfig fields or a "
                    f"CompressionConfig (or a list of them, one per prompt), got "
                    f"{type(policy).__name__}"
                )
        encoded = [encode_prompt(self.tokenizer, p) for p in prompt_list]
        policies = [self._chat_context(p, t, c) for p, t, c in zip(prompt_list, encoded, policies)]
        ids = [f"offline-{next(self._ids)}" for _ in encoded]
        added = []
        try:
            for request_id, tokens, sp, policy in zip(ids, encoded, params, policies):
                self.engine.add_request(request_id, tokens, sp, policy)
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _chat_context(self, prompt, tokens: list[int], policy):
        """A chat prompt under scope ``context`` gets its context length (the tokens before
        the last user message) unless the policy names one; none at all: no compression."""
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            return policy
        resolved = self.engine.resolve_compression(policy)
        if resolved is None or resolved.scope != "context" or resolved.context_tokens:
            return policy
        context = chat_context_tokens(self.tokenizer, prompt, tokens)
        if context == 0:
            return CompressionConfig(method="none")
        return dataclasses.replace(resolved, context_tokens=context)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            # An error out of a step (or an interrupt) must not leave this call's requests
            # queued: the next call would run them, and fail the same way, again.
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        fatal = self.engine.fatal_error
        if fatal is not None:
            raise RuntimeError(f"generate: the engine failed: {fatal}")
        return [finished[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the engine's other processes (``LLMEngine.shutdown``)."""
        self.engine.shutdown()

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None):
        """One chat conversation -> its ``RequestOutput``."""
        return self.generate([messages], sampling_params)[0]


def _default_policy(kv_compression: CompressionConfig | dict | None) -> CompressionConfig:
    """The engine's default policy from ``LLM(kv_compression=...)``.

    Raises:
        ValueError: an unknown field, an invalid policy, or a value that is neither.
    """
    if kv_compression is None:
        return CompressionConfig()
    if isinstance(kv_compression, CompressionConfig):
        return kv_compression
    if isinstance(kv_compression, dict):
        return CompressionConfig().merged(kv_compression)
    raise ValueError(
        "kv_compression: expected None, a dict of CompressionConfig fields or a "
        f"CompressionConfig, got {type(kv_compression).__name__}"
    )


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Iterable) or isinstance(prompts, bytes | Mapping):
        raise ValueError(
            "prompts: expected text, token ids, chat messages or a list of them, got "
            f"{type(prompts).__name__}"
        )
    items = list(prompts)
    if items and all(isinstance(t, numbers.Integral) for t in items):  # numpy integers too
        return [items]
    if items and all(isinstance(m, dict) for m in items):
        return [items]
    if not items:
        raise ValueError("prompts: no prompt given")
    return items


def _broadcast(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name}: got {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _apply_kwargs(config: EngineConfig, kwargs: dict) -> None:
    """Set ``ModelConfig``/``CacheConfig``/``SchedulerConfig``/``ParallelConfig`` fields given
    to ``LLM`` by name (``tensor_parallel_size=2``, as vLLM's ``LLM`` takes it).

    Raises:
        ValueError: a name that is no field of those (the message lists the fields).
    """
    parts = (config.model, config.cache, config.scheduler, config.parallel)
    for key, value in kwargs.items():
        for part in parts:
            if key in {f.name for f in dataclasses.fields(part)}:
                setattr(part, key, value)
                break
        else:
            names = sorted(f.name for part in parts for f in dataclasses.fields(part))
            raise ValueError(
                f"{key}: unknown engine setting; LLM takes model, dtype, kv_compression, "
                f"kv_cache_memory, engine_config or one of: {', '.join(names)}"
            )
