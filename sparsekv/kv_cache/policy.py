"""A request's compression policy, resolved once at admission into one value object.

``resolve_policy`` merges the request's overrides over the engine's settings
(``kv_cache.policy_settings``), applies the scope, computes every layer's budget and the
request's peak footprint, builds the compressor and reads its capabilities. Everything
downstream (scheduler, KV manager, runner and attention) reads the resulting
``CompressionPolicy`` (``kv_cache.compression_policy``); none of them names a method
(docs/compression.md, "Adding a method"; docs/internals.md, "Compression policy").
"""

from __future__ import annotations

import dataclasses

from sparsekv.compression.base import Compressor
from sparsekv.compression.registry import get_compressor
from sparsekv.config import CompressionConfig, EngineConfig, check_head_budgets
from sparsekv.errors import PoolTooSmallError
from sparsekv.kv_cache.budget import layer_budgets
from sparsekv.kv_cache.compression_policy import CompressionPolicy, full_cache_kv
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.kv_cache.plan import KVPolicy
from sparsekv.kv_cache.policy_settings import (
    check_full_layers,
    check_head_budget_method,
    context_length,
    merge_settings,
)
from sparsekv.kv_cache.side_state import side_pages, side_state_bytes

__all__ = [
    "CompressionPolicy",
    "check_head_budget_method",
    "implicit_max_tokens",
    "merge_settings",
    "resolve_policy",
]


def resolve_policy(
    config: EngineConfig,
    overrides: CompressionConfig | dict | None,
    kv: KVCacheManager,
    num_prompt_tokens: int,
    max_tokens: int,
    draft_tokens: int = 0,
    tokenizer=None,
) -> CompressionPolicy:
    """Resolve a request's compression once, at admission.

    Args:
        config: the engine's validated configuration (default settings, parallelism).
        overrides: the request's settings (a field dict or a whole ``CompressionConfig``).
        kv: the KV manager (the model's layer specs, page kinds and pool sizes).
        num_prompt_tokens: the prompt's length.
        max_tokens: most tokens the request generates.
        draft_tokens: draft tokens a verification step holds beyond them (speculation).
        tokenizer: the engine's tokenizer, bound to the compressor (``None``: none).

    Returns:
        The request's policy (a full-cache one when no layer is budgeted).

    Raises:
        ValueError: invalid settings, scope ``context`` without a valid ``context_tokens``,
            a ``layer_budgets``/``layer_fractions`` list of the wrong length, a peak
            footprint over the pool (``PoolTooSmallError``, naming ``max_tokens``), a reconstructing method
            under tensor parallelism, or adaptive head budgets with a setting they do not
            support (``config.check_head_budgets``, attention-mass methods).
    """
    settings = merge_settings(config.compression, overrides)
    check_full_layers(overrides, settings, kv.num_layers)
    context_len = context_length(settings, num_prompt_tokens)
    compressed_len = num_prompt_tokens if context_len is None else context_len
    specs = kv.layer_specs
    budgets: list[int | None] = [None] * len(specs)
    if settings is not None:
        compressible = [spec.compressible for spec in specs]
        budgets = layer_budgets(settings, len(specs), compressed_len, compressible)
    if all(budget is None for budget in budgets):
        settings = context_len = None
    kv_policy = full_cache_kv()
    # One KV head has nothing to share: such a model (Gemma 3 270M) keeps the flat layout.
    head_wise = settings is not None and settings.head_budgets == "adaptive"
    head_wise = head_wise and kv.num_kv_heads > 1
    if settings is not None:
        check_head_budgets(settings, config, speculative=draft_tokens > 0)
        bounded = settings.chunked_mode == "bounded"
        # Head-wise pages are split once at prefill and never re-scored (plan.plan_layers sends
        # them down the growth branch); a layer the prompt did not overflow stays flat and
        # keeps the request's decode-time eviction.
        kv_policy = KVPolicy(settings.decode_eviction, bounded, head_wise=head_wise)
    compressed_len, later_tokens = num_prompt_tokens, max_tokens
    if context_len is not None:
        # Compressed once at the end of the context; the question and output stay whole.
        kv_policy = KVPolicy(
            decode_eviction=False, bounded_chunks=False, context_only=True, head_wise=head_wise
        )
        compressed_len = context_len
        later_tokens = max_tokens + num_prompt_tokens - context_len
    # A verification step holds the slots of its draft tokens until it commits.
    later_tokens += draft_tokens
    compressor = _compressor(settings, config, tokenizer)
    kv_policy = dataclasses.replace(
        kv_policy,
        side_pages=_side_pages(kv, budgets, settings, compressor, compressed_len + later_tokens),
    )
    peaks = kv.peak_pages(budgets, compressed_len, later_tokens, kv_policy)
    side_kind = kv.side_kind
    peaks[side_kind] += kv_policy.side_pages
    for kind, (peak, size) in enumerate(zip(peaks, kv.pool.kind_sizes)):
        if peak > size:
            # With one output token instead: when even that overflows, the prompt is at fault.
            alone = kv.peak_pages(budgets, compressed_len, later_tokens - max_tokens + 1, kv_policy)
            alone[side_kind] += kv_policy.side_pages
            if alone[kind] > size:
                raise PoolTooSmallError(
                    f"prompt: its {num_prompt_tokens} tokens need {alone[kind]} KV pages at the "
                    f"peak with one output token but the pool has {size}; shorten the prompt "
                    "or raise --kv-cache-memory"
                )
            raise PoolTooSmallError(
                f"max_tokens: the request needs {peak} KV pages at its peak but the pool "
                f"has {size}; shorten the prompt or max_tokens, or raise --kv-cache-memory"
            )
    return CompressionPolicy(
        settings, compressor, tuple(budgets), kv_policy, tuple(peaks), context_len
    )


def implicit_max_tokens(
    config: EngineConfig,
    overrides: CompressionConfig | dict | None,
    kv: KVCacheManager,
    num_prompt_tokens: int,
    max_model_len: int,
    draft_tokens: int = 0,
    tokenizer=None,
) -> int:
    """``max_tokens`` of a request that gave none (``SamplingParams(max_tokens=None)``).

    Args:
        config, overrides, kv, num_prompt_tokens, draft_tokens, tokenizer: as for
            :func:`resolve_policy`.
        max_model_len: the context length in tokens.

    Returns:
        Up to the end of the context, or the most tokens whose peak footprint the pool holds
        (:func:`resolve_policy`'s check; the footprint grows with ``max_tokens``, so a binary
        search finds it in ``log2(max_model_len)`` checks).

    Raises:
        PoolTooSmallError: (naming ``prompt``) not even one token fits after the prompt.
    """

    def overflow(max_tokens: int) -> PoolTooSmallError | None:
        try:
            resolve_policy(
                config, overrides, kv, num_prompt_tokens, max_tokens, draft_tokens, tokenizer
            )
        except PoolTooSmallError as exc:
            return exc
        return None

    hi = max(1, max_model_len - num_prompt_tokens)
    if overflow(hi) is None:
        return hi
    lo = 1
    error = overflow(lo)
    if error is not None:  # resolve_policy names the prompt then
        raise error
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if overflow(mid) is None else (lo, mid)
    return lo


def _side_pages(
    kv: KVCacheManager,
    budgets: list[int | None],
    settings: CompressionConfig | None,
    compressor: Compressor | None,
    num_slots: int,
) -> int:
    """Pool pages (of ``kv.side_kind``) the request holds for its side state
    (``kv_cache.side_state``): window
    queries of its budgeted layers, attention masses over up to ``num_slots`` slots where
    the method keeps them, int4 residuals."""
    int4 = kv.kv_cache_dtype == "int4"
    num_bytes = side_state_bytes(
        budgets,
        num_heads=kv.num_heads,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        window=settings.window if settings is not None else 0,
        block_size=kv.block_size,
        num_int4_layers=kv.layer_kinds.count(0) if int4 else 0,
        mass_slots=num_slots if compressor is not None and compressor.needs_attention_mass else 0,
    )
    return side_pages(num_bytes, kv.side_page_bytes)


def _compressor(settings: CompressionConfig | None, config: EngineConfig, tokenizer):
    """The request's compressor, bound to the tokenizer; ``None`` for a full cache.

    Raises:
        ValueError: a reconstructing method under tensor parallelism.
    """
    compressor = get_compressor(settings) if settings is not None else None
    if compressor is None:
        return None
    if compressor.reconstructs and config.parallel.tensor_parallel_size > 1:
        raise ValueError(
            f"kv_compression: {compressor.name} is not supported with tensor "
            "parallelism (the step plan carries no reconstruction rows)"
        )
    check_head_budget_method(settings)
    if tokenizer is not None:
        compressor.bind(tokenizer)
    return compressor
