"""A request's compression settings: merged over the engine's and checked against the model.

``merge_settings`` yields the settings a request runs with; the checks here reject settings
that are valid alone but not for this model or prompt (``full_layers`` covering every layer,
a ``context`` scope longer than the prompt, adaptive head budgets with an attention-mass
method). ``kv_cache.policy.resolve_policy`` runs them at admission.
"""

from __future__ import annotations

from sparsekv.compression.registry import compressor_class
from sparsekv.config import CompressionConfig


def merge_settings(
    base: CompressionConfig, overrides: CompressionConfig | dict | None
) -> CompressionConfig | None:
    """A request's settings: its overrides merged over the engine's, field by field (budget and
    ratio are one choice: giving either replaces the other); a whole ``CompressionConfig``
    replaces them.

    Returns:
        The merged settings, or ``None`` when they compress nothing (method ``none``, ratio 0).

    Raises:
        ValueError: an unknown field or invalid merged settings (naming the field).
    """
    if overrides is None:
        settings = base
    elif isinstance(overrides, CompressionConfig):
        overrides.validate()
        settings = overrides
    else:
        settings = base.merged(dict(overrides))
    return settings if settings.enabled else None


def check_full_layers(
    overrides: CompressionConfig | dict | None, settings: CompressionConfig | None, num_layers: int
) -> None:
    """Reject a request that sets ``full_layers`` to the model's layer count or more: every
    layer would stay full, its compression silently off. Only a field dict naming
    ``full_layers`` is checked (a whole ``CompressionConfig`` or the engine default may carry
    the default of 2 on a model of two layers or fewer); explicit ``layer_budgets`` /
    ``layer_fractions`` override ``full_layers``.

    Raises:
        ValueError: naming ``kv_compression.full_layers`` and the model's layer count.
    """
    if not isinstance(overrides, dict) or "full_layers" not in overrides or settings is None:
        return
    if settings.layer_budgets is not None or settings.layer_fractions is not None:
        return
    if settings.full_layers >= num_layers:
        raise ValueError(
            f"kv_compression.full_layers ({settings.full_layers}) must be < the model's "
            f"{num_layers} layers"
        )


def check_head_budget_method(settings: CompressionConfig) -> None:
    """Adaptive head budgets need a method scored at prefill (checked at engine start for the
    default policy, and per request).

    Raises:
        ValueError: naming ``kv_compression.head_budgets`` for a method that accumulates
            attention mass (H2O), whose per-slot state assumes equal-length heads.
    """
    if settings.head_budgets != "adaptive" or not settings.enabled:
        return
    if compressor_class(settings.method).needs_attention_mass:
        raise ValueError(
            f"kv_compression.head_budgets: {settings.method} accumulates attention mass per "
            "slot of equal-length heads; adaptive budgets take a method scored at prefill"
        )


def context_length(settings: CompressionConfig | None, num_prompt: int) -> int | None:
    """The shared context's length for scope ``context`` (else ``None``).

    Raises:
        ValueError: scope ``context`` without ``context_tokens``, or more context than prompt.
    """
    if settings is None or settings.scope != "context":
        return None
    if settings.context_tokens is None:
        raise ValueError(
            "kv_compression.context_tokens: scope 'context' needs the context length (chat "
            "requests get it from the messages before the last user message)"
        )
    if settings.context_tokens > num_prompt:
        raise ValueError(
            f"kv_compression.context_tokens: {settings.context_tokens} exceeds the prompt's "
            f"{num_prompt} tokens"
        )
    return settings.context_tokens
