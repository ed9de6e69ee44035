"""Per-layer KV budgets and peak footprints: pure functions of a policy
(docs/design.md, "Budgets and ratios" and "KV memory").

A budget is the number of slots a budgeted layer keeps, observation window included; ``None``
means the layer keeps a full cache (full-first-N layers, sliding-window layers, policy off).
Schedules: uniform, a method's own (``Compressor.layer_schedule``: PyramidKV, arXiv 2406.02069),
explicit list.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sparsekv.compression.pyramidkv import PYRAMID_BETA, pyramid_budgets
from sparsekv.compression.registry import compressor_class
from sparsekv.config import CompressionConfig
from sparsekv.kv_cache.spec import LayerSpec

__all__ = [
    "PYRAMID_BETA",
    "base_budget",
    "layer_budgets",
    "may_compact",
    "num_pages",
    "peak_layer_slots",
    "peak_request_pages",
    "peak_sliding_slots",
    "pyramid_budgets",
    "ratio_budget",
    "uniform_budgets",
]

# Float products such as (1 - 0.7) * 1000 = 300.00000000000006 must not round up to 301.
_RATIO_EPS = 1e-9


def ratio_budget(compression_ratio: float, window: int, num_prompt_tokens: int) -> int:
    """Budget of a compression ratio (fraction removed): ``max(window + 1, ceil((1 - r) * n))``."""
    kept = math.ceil((1.0 - compression_ratio) * num_prompt_tokens - _RATIO_EPS)
    return max(window + 1, kept)


def base_budget(config: CompressionConfig, num_prompt_tokens: int) -> int:
    """The policy's per-layer budget before any schedule (the average for PyramidKV).

    Raises:
        ValueError: the policy gives neither a budget nor a ratio.
    """
    if config.budget is not None:
        return config.budget
    if config.compression_ratio is None:
        raise ValueError("kv_compression.budget: give a budget or a compression_ratio")
    return ratio_budget(config.compression_ratio, config.window, num_prompt_tokens)


def uniform_budgets(budget: int, window: int, num_prompt_tokens: int, num_layers: int) -> list[int]:
    """Every budgeted layer keeps ``budget`` slots (SnapKV and the other methods)."""
    return [budget] * num_layers


def layer_budgets(
    config: CompressionConfig,
    num_layers: int,
    num_prompt_tokens: int,
    compressible: list[bool],
    schedule: Callable[[int, int, int, int], list[int]] | None = None,
) -> list[int | None]:
    """Budget of every layer of a request; ``None`` = full cache.

    Order of rules: policy off (method ``none`` or ratio 0) -> all ``None``; an explicit
    ``config.layer_fractions`` (1 = full; else ``max(window + 1, ceil(f * n))``) or
    ``config.layer_budgets`` list wins next (0 = full); otherwise the first ``full_layers``
    layers are full and the rest are budgeted by the method's schedule over the budgeted layers
    only. Non-compressible (sliding-window) layers are always ``None``.

    Args:
        config: a validated policy.
        num_layers: decoder layers of the model.
        num_prompt_tokens: tokens the policy compresses (the prompt, or the shared context).
        compressible: ``[num_layers]``, False for sliding-window layers.
        schedule: ``(budget, window, n, num_budgeted) -> budgets``; ``None``: the method's
            ``Compressor.layer_schedule``.

    Returns:
        ``[num_layers]`` budgets in slots, each ``>= window + 1``, or ``None``.

    Raises:
        ValueError: ``layer_budgets`` or ``layer_fractions`` has the wrong length, no budget or
            ratio is given, or the method is unknown.
    """
    assert len(compressible) == num_layers, (len(compressible), num_layers)
    if not config.enabled:
        return [None] * num_layers
    if config.layer_fractions is not None:
        if len(config.layer_fractions) != num_layers:
            raise ValueError(
                f"kv_compression.layer_fractions: {len(config.layer_fractions)} fractions for a "
                f"model with {num_layers} layers"
            )
        return [
            None
            if fraction >= 1 or not compressible[layer]
            else max(config.window + 1, math.ceil(fraction * num_prompt_tokens - _RATIO_EPS))
            for layer, fraction in enumerate(config.layer_fractions)
        ]
    if config.layer_budgets is not None:
        if len(config.layer_budgets) != num_layers:
            raise ValueError(
                f"kv_compression.layer_budgets: {len(config.layer_budgets)} budgets for a model "
                f"with {num_layers} layers"
            )
        return [
            budget if budget and compressible[layer] else None
            for layer, budget in enumerate(config.layer_budgets)
        ]
    budgeted = [
        layer for layer in range(num_layers) if layer >= config.full_layers and compressible[layer]
    ]
    if schedule is None:
        schedule = compressor_class(config.method).layer_schedule
    budgets = schedule(
        base_budget(config, num_prompt_tokens), config.window, num_prompt_tokens, len(budgeted)
    )
    result: list[int | None] = [None] * num_layers
    for layer, budget in zip(budgeted, budgets):
        result[layer] = budget
    return result


def peak_layer_slots(
    budget: int | None,
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    decode_eviction: bool,
) -> int:
    """Most slots a full (``budget=None``) or budgeted layer ever holds.

    Full: ``n + max_tokens``. Budgeted with decode eviction:
    ``min(n + max_tokens, max(min(n, budget), budget + block_size))``; without it
    ``min(n, budget) + max_tokens``. (The uncompressed prompt held during an exact-mode chunked
    prefill is the caller's to add.)
    """
    total = num_prompt_tokens + max_tokens
    if budget is None:
        return total
    kept = min(num_prompt_tokens, budget)
    if decode_eviction:
        return min(total, max(kept, budget + block_size))
    return kept + max_tokens


def peak_sliding_slots(sliding_window: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Most slots a sliding-window layer holds: ``window + max_num_batched_tokens + block_size``."""
    return sliding_window + max_num_batched_tokens + block_size


def may_compact(
    budgets: list[int | None],
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    decode_eviction: bool,
) -> bool:
    """Whether any budgeted layer can ever compact: the prompt exceeds its budget, or decode
    eviction reaches ``budget + block_size`` slots within ``max_tokens``."""
    for budget in budgets:
        if budget is None:
            continue
        if num_prompt_tokens > budget:
            return True
        if decode_eviction and num_prompt_tokens + max_tokens >= budget + block_size:
            return True
    return False


def peak_request_pages(
    specs: list[LayerSpec],
    budgets: list[int | None],
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    max_num_batched_tokens: int,
    decode_eviction: bool,
    bounded_chunks: bool,
    head_slack: int = 0,
) -> int:
    """Peak pages of a request over all layers, for the never-fits check.

    Sliding layers hold at most their window plus one step and a page; an exact-mode chunked
    prefill (prompt over the step token budget) holds a budgeted layer's uncompressed earlier
    chunks until the last one, while a single-shot prefill never writes them. With adaptive
    head budgets (``head_slack`` > 0: the KV heads) a budgeted layer the prompt overflows is
    split into head-wise pages at its compressing step: at most ``head_slack`` pages more than
    the flat layout (one partial page per head), and no decode-time eviction after it. A layer
    the prompt fits is never split (decode-time eviction compacts flat, and a request with a
    budgeted layer is swapped, never recomputed, on preemption): it counts as flat.
    """
    n = num_prompt_tokens
    total = 0
    for spec, budget in zip(specs, budgets):
        if spec.is_sliding:
            bound = peak_sliding_slots(spec.sliding_window, max_num_batched_tokens, block_size)
            peak = min(n + max_tokens, bound)
        else:
            split = head_slack > 0 and budget is not None and n > budget
            peak = peak_layer_slots(
                budget, n, max_tokens, block_size, decode_eviction and not split
            )
            if budget is not None and n > max_num_batched_tokens and not bounded_chunks:
                peak = max(peak, n)
            if split:
                total += head_slack
        total += num_pages(peak, block_size)
    return total


def num_pages(num_slots: int, block_size: int) -> int:
    """Pages needed for ``num_slots`` slots: ``ceil(num_slots / block_size)``."""
    return -(-num_slots // block_size)
