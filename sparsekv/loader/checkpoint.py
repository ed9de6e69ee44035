"""The loader facade: a model argument in, a :class:`Checkpoint` out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sparsekv.loader.gguf import load_gguf
from sparsekv.loader.resolve import BUILTIN_MODELS, resolve_model
from sparsekv.loader.safetensors import load_hf_folder


@dataclass
class Checkpoint:
    """Everything the engine needs from a model, in Hugging Face conventions.

    Attributes:
        name: served model name: the built-in name, else the GGUF file stem or folder name.
        path: the GGUF file or HF folder it came from.
        hf_config: transformers ``PretrainedConfig``; for Gemma 3 the text config
            (``Gemma3TextConfig``, with ``layer_types``, ``sliding_window``, ``rope_parameters``
            per attention type, ``query_pre_attn_scalar``).
        tokenizer: transformers tokenizer with a ``chat_template``.
        state_dict: HF parameter name -> contiguous tensor in the requested dtype.
            ``lm_head.weight`` is absent when ``hf_config.tie_word_embeddings`` (the head is
            ``model.embed_tokens.weight``). Gemma norm weights follow HF (``x * (1 + w)``).
    """

    name: str
    path: Path
    hf_config: object
    tokenizer: object
    state_dict: dict[str, torch.Tensor]


def load_checkpoint(model: str, dtype: torch.dtype) -> Checkpoint:
    """Load config, tokenizer and weights of a built-in name, GGUF file or HF folder.

    GGUF files (DESIGN.md §7) are dequantized with the ``gguf`` package; config and tokenizer
    come from transformers (cached after the first load, see
    :mod:`sparsekv.loader.gguf_metadata`). Nothing is downloaded.

    Args:
        model: ``smollm2-135m-instruct``, ``gemma3-270m``, a ``.gguf`` path, or a folder with
            ``config.json`` and ``*.safetensors``.
        dtype: floating dtype of the state dict (``torch.float32`` or ``torch.bfloat16``).

    Returns:
        A :class:`Checkpoint`.

    Raises:
        ValueError: ``dtype`` is not a floating dtype (message starts with ``dtype:``); the
            model is unknown, missing, corrupt or unsupported (message starts with ``model:``).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    path = resolve_model(model)
    load = load_gguf if path.is_file() else load_hf_folder
    hf_config, tokenizer, state_dict = load(path, dtype)
    name = model if model in BUILTIN_MODELS else (path.stem if path.is_file() else path.name)
    return Checkpoint(
        name=name,
        path=path,
        hf_config=hf_config,
        tokenizer=tokenizer,
        state_dict=state_dict,
    )
