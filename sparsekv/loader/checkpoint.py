"""The loader facade: a model argument in, a :class:`Checkpoint` out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sparsekv.loader.gguf import load_gguf
from sparsekv.loader.gguf_file import read_gguf
from sparsekv.loader.gguf_metadata import load_gguf_config_and_tokenizer
from sparsekv.loader.gguf_packed import load_packed_weights
from sparsekv.loader.hf_config import check_layer_count
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
        packed_weights: with ``weight_dtype="gguf"``, HF name -> the GGUF file's raw blocks of
            that linear weight (``sparsekv.models.quant.formats.PackedTensor``); the dense
            ``state_dict`` still holds every tensor.
        dense_linear_weights: with ``weight_dtype="gguf"``, the linear weights kept dense
            (``"name (TYPE)"``: a block type the packed kernels do not read).
    """

    name: str
    path: Path
    hf_config: object
    tokenizer: object
    state_dict: dict[str, torch.Tensor]
    eos_token_ids: tuple[int, ...] = ()
    packed_weights: dict = field(default_factory=dict)
    dense_linear_weights: list[str] = field(default_factory=list)


def load_checkpoint(
    model: str, dtype: torch.dtype, tokenizer: str | None = None, weight_dtype: str = "auto"
) -> Checkpoint:
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
        weight_dtype: ``gguf`` also keeps the file's quantized linear weights as raw blocks
            (``Checkpoint.packed_weights``); other values load as ``auto``.

    Returns:
        A :class:`Checkpoint`.

    Raises:
        ValueError: ``dtype`` is not a floating dtype (message starts with ``dtype:``); the
            model is unknown, missing, corrupt or unsupported (message starts with ``model:``);
            the tokenizer path does not load (message starts with ``tokenizer:``);
            ``weight_dtype`` is ``gguf`` and the model is not a GGUF file (message starts with
            ``weight_dtype:``).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    path = resolve_model(model)
    if weight_dtype == "gguf" and not path.is_file():
        raise ValueError(
            f"weight_dtype: gguf keeps a GGUF file's quantized blocks, but {str(path)!r} is a "
            "Hugging Face folder; use int8 or bf16 to pack its weights at load"
        )
    override = load_tokenizer(tokenizer) if tokenizer is not None else None
    eos_ids: tuple[int, ...] = ()
    if path.is_file():
        hf_config, own, state_dict = load_gguf(path, dtype)
        check_layer_count(hf_config, state_dict, f"{path}'s block_count")
    else:
        hf_config, own, state_dict = load_hf_folder(path, dtype, with_tokenizer=override is None)
        eos_ids = generation_eos_ids(path)
    packed, dense = load_packed_weights(path, hf_config) if weight_dtype == "gguf" else ({}, [])
    name = model if model in BUILTIN_MODELS else (path.stem if path.is_file() else path.name)
    return Checkpoint(
        name=name,
        path=path,
        hf_config=hf_config,
        tokenizer=override if override is not None else own,
        state_dict=state_dict,
        eos_token_ids=eos_ids,
        packed_weights=packed,
        dense_linear_weights=dense,
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
