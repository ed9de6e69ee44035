"""The model's context length and the engine's ``max_model_len``.

The context is what the checkpoint's config states: ``max_position_embeddings``, stretched by
the RoPE scaling where its type extends the positions past it (``linear``, ``dynamic``,
``yarn``: times ``factor``; yarn's base is ``original_max_position_embeddings`` where given),
as vLLM derives it, but never shorter than ``max_position_embeddings``. ``llama3`` and ``longrope`` configs state the extended length in
``max_position_embeddings`` already, and so does Gemma 3, whose per-layer-type RoPE settings are
left out. ``--max-model-len`` longer than the context is refused unless
``SPARSEKV_ALLOW_LONG_MAX_MODEL_LEN`` is on (vLLM: ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``).
"""

from __future__ import annotations

import logging

from sparsekv.config import EngineConfig
from sparsekv.env_flags import switched_on

__all__ = ["DEFAULT_CONTEXT", "LONG_MAX_MODEL_LEN", "model_context", "model_len_of"]

logger = logging.getLogger(__name__)

LONG_MAX_MODEL_LEN = "SPARSEKV_ALLOW_LONG_MAX_MODEL_LEN"
DEFAULT_CONTEXT = 2048  # a config that states no context
STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def _rope_settings(hf_config) -> dict:
    """The config's one set of RoPE settings (``rope_parameters``, transformers 5, or
    ``rope_scaling``), or ``{}`` where it has none or one per layer type (Gemma 3)."""
    for key in ("rope_parameters", "rope_scaling"):
        settings = getattr(hf_config, key, None)
        if isinstance(settings, dict) and settings:
            if any(isinstance(value, dict) for value in settings.values()):
                return {}
            return settings
    return {}


def model_context(hf_config) -> tuple[int, str]:
    """The context length ``hf_config`` states, in tokens, and where it comes from (for
    messages): ``max_position_embeddings`` (:data:`DEFAULT_CONTEXT` where absent), times the
    RoPE ``factor`` where the rope type stretches positions (:data:`STRETCHING_ROPE_TYPES`;
    yarn from ``original_max_position_embeddings`` where set), never less than
    ``max_position_embeddings`` (configs that state the stretched length there, e.g. yarn with
    ``max_position_embeddings`` = original x factor, keep it).
    """
    stated = getattr(hf_config, "max_position_embeddings", None)
    context = stated or DEFAULT_CONTEXT
    source = "max_position_embeddings" if stated else f"the config sets none; {context} assumed"
    settings = _rope_settings(hf_config)
    rope_type = settings.get("rope_type", settings.get("type", "default"))
    factor = settings.get("factor")
    if rope_type not in STRETCHING_ROPE_TYPES or not factor or float(factor) <= 1.0:
        return context, source
    original = settings.get("original_max_position_embeddings") if rope_type == "yarn" else None
    base = int(original) if original else context
    stretched = int(base * float(factor))
    if stretched <= context:  # a config that states the stretched length already
        return context, source
    base_source = "original_max_position_embeddings" if original else source
    return stretched, f"{base_source} {base} x {rope_type} factor {factor}"


def model_len_of(config: EngineConfig, hf_config) -> int:
    """``--max-model-len``, else the model's context (:func:`model_context`).

    Raises:
        ValueError: (names ``max_model_len``) it is longer than the model's context, unless
            ``SPARSEKV_ALLOW_LONG_MAX_MODEL_LEN`` is on: then it is used, with a warning.
    """
    context, source = model_context(hf_config)
    requested = config.model.max_model_len
    if requested is None:
        return context
    if requested > context:
        if not switched_on(LONG_MAX_MODEL_LEN):
            raise ValueError(
                f"max_model_len: {requested} tokens is longer than the model's context length "
                f"of {context} tokens ({source}); serve at most {context}, or set "
                f"{LONG_MAX_MODEL_LEN}=1 to use {requested} anyway (outputs past the model's "
                "context may be wrong)"
            )
        logger.warning(
            "max_model_len %d is longer than the model's context length of %d tokens (%s); "
            "used because %s is set: outputs past the model's context may be wrong",
            requested,
            context,
            source,
            LONG_MAX_MODEL_LEN,
        )
    return requested
