"""Model type -> model class (a table, not an if/elif ladder)."""

from __future__ import annotations

import torch

from sparsekv.models.layers import RotaryEmbedding
from sparsekv.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[torch.nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def register_model(model_type: str, cls: type[torch.nn.Module]) -> None:
    """Add a model class for a transformers ``model_type``."""
    MODEL_CLASSES[model_type] = cls


def build_model(
    hf_config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: str
) -> torch.nn.Module:
    """Instantiate the model for ``hf_config.model_type`` and load Hugging Face weights.

    Raises:
        ValueError: the model type is not supported.
    """
    _register_optional()
    model_type = hf_config.model_type
    if model_type not in MODEL_CLASSES:
        raise ValueError(
            f"model: architecture {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    with torch.device("meta"):
        model = MODEL_CLASSES[model_type](hf_config)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()  # computed buffers, not checkpoint weights
    model.load_hf_state_dict(state_dict)
    return model.eval()


def _register_optional() -> None:
    try:
        from sparsekv.models.gemma3 import Gemma3ForCausalLM
    except ImportError:
        return
    MODEL_CLASSES.setdefault("gemma3_text", Gemma3ForCausalLM)
    MODEL_CLASSES.setdefault("gemma3", Gemma3ForCausalLM)
