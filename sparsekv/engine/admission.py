"""What ``LLMEngine.add_request`` checks and builds before a request reaches the scheduler.

The checks reject a request whole, before any of its samples is registered: its prompt, its
sampling parameters against the model and the scheduler, its speculative settings. Then a
``max_tokens`` left unset is resolved against the pool, and each sample gets its ``Request``
with its own random streams.
"""

from __future__ import annotations

import dataclasses

import torch

from sparsekv.config import CompressionConfig, EngineConfig, SpeculativeConfig
from sparsekv.engine.request import Request
from sparsekv.errors import ContextLengthError
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.kv_cache.policy import CompressionPolicy, implicit_max_tokens
from sparsekv.sampling_params import SamplingParams


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Reject a prompt the model cannot run.

    Raises:
        ValueError: an empty prompt or a token id outside ``[0, vocab_size)``.
        ContextLengthError: (a ``ValueError``) a prompt of at least ``max_model_len`` tokens.
    """
    if not prompt_token_ids:
        raise ValueError("prompt: the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ContextLengthError(
            f"prompt: {len(prompt_token_ids)} tokens leave no room in the context of "
            f"{max_model_len} tokens"
        )
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} is outside [0, {vocab_size})")


def check_sampling_params(
    params: SamplingParams,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    max_num_seqs: int,
) -> None:
    """Validate ``params`` for a prompt of ``num_prompt_tokens`` on this engine.

    Raises:
        ValueError: invalid parameters (``SamplingParams.validate``), a stop token id outside
            ``[0, vocab_size)``, or ``n`` over ``max_num_seqs``.
        ContextLengthError: (a ``ValueError``) the prompt plus ``max_tokens`` over
            ``max_model_len``.
    """
    params.validate(max_model_len=max_model_len, num_prompt_tokens=num_prompt_tokens)
    bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stops:
        raise ValueError(f"stop_token_ids: token id {bad_stops[0]} is outside [0, {vocab_size})")
    if params.n > max_num_seqs:  # as the server's check: the samples run side by side
        raise ValueError(f"n must be <= max_num_seqs ({max_num_seqs}), got {params.n}")


def resolve_speculative(
    base: SpeculativeConfig, overrides: dict | None, kv_cache_dtype: str
) -> SpeculativeConfig | None:
    """Merge a request's ``speculative`` fields over the engine's settings ``base``.

    Returns:
        The request's settings, or ``None`` when it decodes one token per step.

    Raises:
        ValueError: an unknown field, an invalid merged setting, a field the request's
            method never reads (``SpeculativeConfig.check_request_fields``), or
            speculation over int4 pages.
    """
    spec = base if overrides is None else base.merged(dict(overrides))
    if overrides is not None:
        spec.check_request_fields(overrides)
    if not spec.enabled:
        return None
    if kv_cache_dtype == "int4":
        raise ValueError("speculative: int4 pages cannot roll draft tokens back")
    return spec


def with_max_tokens(
    params: SamplingParams,
    config: EngineConfig,
    compression: CompressionConfig | dict | None,
    kv: KVCacheManager,
    num_prompt_tokens: int,
    max_model_len: int,
    draft_tokens: int,
    tokenizer,
) -> SamplingParams:
    """``params`` with ``max_tokens`` set: as given, or for ``None`` the most the context and
    the pool allow (``kv_cache.policy.implicit_max_tokens``), ``min_tokens`` checked against
    it.

    Raises:
        PoolTooSmallError: (a ``ValueError``, naming ``prompt``) not even one output token
            fits after the prompt.
        ValueError: ``min_tokens`` over the resolved ``max_tokens``.
    """
    if params.max_tokens is not None:
        return params
    max_tokens = implicit_max_tokens(
        config, compression, kv, num_prompt_tokens, max_model_len, draft_tokens, tokenizer
    )
    params = dataclasses.replace(params, max_tokens=max_tokens)
    params.validate(max_model_len, num_prompt_tokens)  # min_tokens against it
    return params


def make_request(
    sample_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    policy: CompressionPolicy,
    index: int,
    forced_token_ids: list[int] | None,
    eos_token_ids: tuple[int, ...],
    device: torch.device | str,
    model_seed: int,
) -> Request:
    """The ``Request`` of sample ``index`` of a request.

    A seeded request gets a sampling generator on ``device`` (a seeded row draws its uniforms
    where the logits are) seeded ``seed + index``; every sample gets a CPU generator for the
    KV cache's random choices, seeded ``seed + index`` (``model_seed + index`` without a
    seed).
    """
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed + index)
    kv_generator = torch.Generator().manual_seed(
        (params.seed if params.seed is not None else model_seed) + index
    )
    return Request(
        request_id=sample_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        policy=policy,
        eos_token_ids=eos_token_ids,
        generator=generator,
        forced_token_ids=forced_token_ids,
        kv_generator=kv_generator,
        sample_index=index,
    )
