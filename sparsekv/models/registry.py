"""Build the model of a checkpoint: its family's decoder, weights loaded (``build_model``)."""

from __future__ import annotations

import logging

import torch

from sparsekv.models.decoder import DecoderForCausalLM, text_config
from sparsekv.models.families import FAMILIES, family_of, supported_model_types
from sparsekv.models.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

__all__ = ["FAMILIES", "build_model", "supported_model_types"]


def build_model(
    hf_config,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str,
    max_model_len: int | None = None,
) -> DecoderForCausalLM:
    """Instantiate the decoder for ``hf_config.model_type`` and load Hugging Face weights.

    Args:
        hf_config: a transformers config of a supported family (``sparsekv models``).
        state_dict: HF parameter names -> tensors (``sparsekv.loader.Checkpoint``).
        dtype: model dtype.
        device: torch device.
        max_model_len: longest sequence the engine serves (sliding windows at least this long
            are no windows; length-dependent RoPE factors are chosen from it).

    Returns:
        The model in eval mode (an ``interface.CausalLM``).

    Raises:
        ValueError: the architecture is not supported (the message lists the supported
            ones), or a tensor is missing or has the wrong shape (naming it).
    """
    family_of(text_config(hf_config))  # the supported-architecture check, before any work
    with torch.device("meta"):
        model = DecoderForCausalLM(hf_config, max_model_len)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()  # computed buffers, not checkpoint weights
    model.load_hf_state_dict(state_dict)
    _log_layout(model)
    return model.eval()


def _log_layout(model: DecoderForCausalLM) -> None:
    variant = model.variant
    specs = model.layer_specs()
    sliding = sum(spec.is_sliding for spec in specs)
    if sliding:
        logger.info(
            "model: %s: %d of %d layers attend through a %d-token sliding window; their pages "
            "outside the window are freed, and they are never compressed or prefix-cached",
            variant.family,
            sliding,
            len(specs),
            variant.sliding_window,
        )
