"""Load a Hugging Face folder: config.json, tokenizer files and one or more *.safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoTokenizer

from sparsekv.loader.hf_config import check_layer_count, load_hf_config

# Multimodal checkpoints (e.g. Gemma 3 4B's Gemma3ForConditionalGeneration) keep the text model
# under these prefixes; the engine serves the text model only, with HF's text-model names.
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_SKIPPED_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                     "multi_modal_projector.")  # fmt: skip


def load_hf_folder(folder: str | Path, dtype: torch.dtype, with_tokenizer: bool = True):
    """Read an HF folder into ``(hf_config, tokenizer, state_dict)``.

    Args:
        folder: holds ``config.json``, tokenizer files and ``*.safetensors`` (one file or shards).
        dtype: floating dtype of the returned tensors.
        with_tokenizer: load the folder's tokenizer (``None`` is returned otherwise).

    Returns:
        ``(hf_config, tokenizer, state_dict)``: the config (for a multimodal config, its
        ``text_config``), the tokenizer, and HF text-model parameter names to contiguous tensors in
        ``dtype`` (``lm_head.weight`` may be absent when ``tie_word_embeddings``).

    Raises:
        ValueError: (message starts with ``model:``) ``config.json`` holds a bad value (naming
            the field and the value, see :mod:`sparsekv.loader.hf_config`), a safetensors file
            is unreadable, the tensors' layers are not the config's ``num_hidden_layers``, or
            the folder has no tokenizer.
    """
    folder = Path(folder)
    config = load_hf_config(folder)
    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(
                f"model: cannot load a tokenizer from {folder}: {exc} (--tokenizer PATH "
                "names another)"
            ) from exc
    state_dict = {}
    for file in sorted(folder.glob("*.safetensors")):
        state_dict.update(_read_safetensors(file, dtype))
    check_layer_count(config, state_dict, str(folder / "config.json"))
    return config, tokenizer, state_dict


def generation_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """``eos_token_id`` of the folder's ``generation_config.json`` as a tuple (Llama 3.x lists
    several there, ``<|eot_id|>`` among them); ``()`` without one."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot read {path}: {exc}") from exc
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(int(token) for token in eos)
    return ()


def _read_safetensors(file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"model: cannot read {file}: {exc}") from exc
    state_dict = {}
    for name, tensor in tensors.items():
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        state_dict[_text_model_name(name)] = tensor.to(dtype).contiguous()
    return state_dict


def _text_model_name(name: str) -> str:
    for prefix, replacement in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name
