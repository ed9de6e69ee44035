"""``sparsekv convert``: write a GGUF checkpoint as a Hugging Face folder other engines load."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from sparsekv.loader.gguf import load_gguf
from sparsekv.models.families import FAMILIES

# transformers / vLLM pick the model class from config.architectures, which GGUF configs lack.
ARCHITECTURE_CLASSES = {
    model_type: family.hf_architecture
    for family in FAMILIES.values()
    for model_type in family.model_types
}

# Chat turns end with this token; generation should stop there as well as at config.eos.
END_OF_TURN_TOKENS = {"gemma3_text": "<end_of_turn>"}


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Dequantize a GGUF file into an HF folder.

    Writes ``config.json`` (with ``architectures`` and ``dtype``), ``model.safetensors``
    (contiguous tensors in ``dtype``, HF names, no ``lm_head.weight`` when tied),
    ``generation_config.json`` (bos/eos/pad, plus the end-of-turn token for Gemma 3) and the
    tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``).
    The folder loads with :func:`sparsekv.loader.load_checkpoint` and with
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: output folder (created; existing files of the same names are overwritten).
        dtype: weight dtype; bf16 (default) halves the size, float32 keeps the dequantized
            values exactly.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: (message starts with ``model:``) the GGUF file is missing, malformed or
            unsupported; (``out_dir:``) the folder cannot be created.
    """
    out_dir = Path(out_dir)
    try:  # before the (slow) load: a folder it cannot write fails at once
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"out_dir: cannot create {out_dir}: {exc.strerror or exc}") from exc
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"out_dir: {out_dir} is not writable")
    config, tokenizer, state_dict = load_gguf(gguf_path, dtype)
    config = copy.deepcopy(config)
    config.architectures = [ARCHITECTURE_CLASSES.get(config.model_type, "AutoModelForCausalLM")]
    config.dtype = dtype
    try:
        save_file(state_dict, out_dir / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(out_dir)
        _generation_config(config, tokenizer).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    except OSError as exc:
        raise ValueError(f"out_dir: cannot write into {out_dir}: {exc.strerror or exc}") from exc
    return out_dir


def _generation_config(config, tokenizer) -> GenerationConfig:
    generation = GenerationConfig.from_model_config(config)
    eos = generation.eos_token_id
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    end_of_turn = END_OF_TURN_TOKENS.get(config.model_type)
    if end_of_turn is not None:
        token_id = tokenizer.convert_tokens_to_ids(end_of_turn)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    generation.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return generation
