"""The loader facade: a model argument in, a :class:`Checkpoint` out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sparsekv.loader.gguf import load_gguf
from sparsekv.loader.gguf_file import read_gguf
from sparsekv.loader.gguf_metadata import load_gguf_config_and_tokenizer
from sparsekv.loader.resolve import BUILTIN_MODELS, resolve_model
from sparsekv.loader.safetensors import generation_eos_ids, load_hf_folder


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
            A Llama 3.x GGUF file adds llama.cpp's ``rope_freqs.weight`` (RoPE factors).
        eos_token_ids: end-of-sequence ids of ``generation_config.json`` (HF folders), which
            stop generation as well as the config's and the tokenizer's.
    """

    name: str
    path: Path
    hf_config: object
    tokenizer: object
    state_dict: dict[str, torch.Tensor]
    eos_token_ids: tuple[int, ...] = ()


def load_checkpoint(model: str, dtype: torch.dtype, tokenizer: str | None = None) -> Checkpoint:
    """Load config, tokenizer and weights of a built-in name, GGUF file or HF folder.

    GGUF files are dequantized with the ``gguf`` package; config and tokenizer
    come from transformers (cached after the first load, see
    :mod:`sparsekv.loader.gguf_metadata`). Nothing is downloaded.

    Args:
        model: ``smollm2-135m-instruct``, ``gemma3-270m``, a ``.gguf`` path, or a folder with
            ``config.json`` and ``*.safetensors``.
        dtype: floating dtype of the state dict (``torch.float32`` or ``torch.bfloat16``).
        tokenizer: a tokenizer folder, ``tokenizer.json`` or GGUF file to use instead of the
            model's own (``--tokenizer``); the model's folder then needs none.

    Returns:
        A :class:`Checkpoint`.

    Raises:
        ValueError: ``dtype`` is not a floating dtype (message starts with ``dtype:``); the
            model is unknown, missing, corrupt or unsupported (message starts with ``model:``);
            the tokenizer path does not load (message starts with ``tokenizer:``).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    path = resolve_model(model)
    override = load_tokenizer(tokenizer) if tokenizer is not None else None
    eos_ids: tuple[int, ...] = ()
    if path.is_file():
        hf_config, own, state_dict = load_gguf(path, dtype)
    else:
        hf_config, own, state_dict = load_hf_folder(path, dtype, with_tokenizer=override is None)
        eos_ids = generation_eos_ids(path)
    name = model if model in BUILTIN_MODELS else (path.stem if path.is_file() else path.name)
    return Checkpoint(
        name=name,
        path=path,
        hf_config=hf_config,
        tokenizer=override if override is not None else own,
        state_dict=state_dict,
        eos_token_ids=eos_ids,
    )


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from a folder, a ``tokenizer.json`` file or a GGUF file.

    Raises:
        ValueError: (message starts with ``tokenizer:``) the path does not exist or holds no
            tokenizer transformers can load.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"tokenizer: {str(path)!r} is neither a tokenizer folder nor a file")
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(path)
        if path.suffix == ".gguf":
            return load_gguf_config_and_tokenizer(read_gguf(path))[1]
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path}: {exc}") from exc
