"""Load a GGUF checkpoint as a Hugging Face state dict, config and tokenizer.

Tensors are dequantized with ``gguf.quants.dequantize`` (exactly what transformers' own GGUF
loader does), renamed with :mod:`sparsekv.loader.name_maps` and fixed up with
:mod:`sparsekv.loader.transforms`, so the result loads into transformers' ``LlamaForCausalLM`` /
``Gemma3ForCausalLM`` unchanged.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from sparsekv.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf
from sparsekv.loader.gguf_metadata import load_gguf_config_and_tokenizer
from sparsekv.loader.name_maps import ARCHITECTURES, ArchSpec
from sparsekv.loader.transforms import TRANSFORMS


@dataclass(frozen=True)
class _TensorPlan:
    info: GGUFTensorInfo
    hf_name: str
    transforms: tuple[str, ...]


def load_gguf(path: str | Path, dtype: torch.dtype):
    """Read a GGUF file into ``(hf_config, tokenizer, state_dict)``.

    Args:
        path: the ``.gguf`` file (architectures: ``llama``, ``gemma3``).
        dtype: floating dtype of the returned tensors (dequantized in float32, then cast).

    Returns:
        ``(hf_config, tokenizer, state_dict)``; see :func:`gguf_state_dict` for the tensors.

    Raises:
        ValueError: (message starts with ``model:``) the file is missing or malformed, or its
            architecture or a tensor name is not supported.
    """
    gguf = read_gguf(path)
    spec = _arch_spec(gguf)
    config, tokenizer = load_gguf_config_and_tokenizer(gguf)
    return config, tokenizer, gguf_state_dict(gguf, spec, config, dtype)


def gguf_state_dict(gguf: GGUFFile, spec: ArchSpec, config, dtype: torch.dtype):
    """Dequantize, rename and fix up every tensor of a parsed GGUF file.

    Args:
        gguf: the parsed file.
        spec: its architecture's name table.
        config: the HF config (head counts for the Q/K un-permutation).
        dtype: dtype of the returned tensors.

    Returns:
        ``dict[str, Tensor]`` keyed by HF parameter names (``model.layers.0.self_attn.q_proj.
        weight``, linear weights ``[out_features, in_features]``), contiguous, in ``dtype``.
        ``lm_head.weight`` is absent when the file has no ``output.weight``: the model ties it
        to ``model.embed_tokens.weight`` (``config.tie_word_embeddings`` is then True).
    """
    plans = _plan(gguf, spec)
    # numpy's dequantization and torch's ops release the GIL for most of their work.
    num_workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(num_workers) as pool:
        tensors = pool.map(lambda plan: _load_tensor(gguf, plan, config, dtype), plans)
        return {plan.hf_name: tensor for plan, tensor in zip(plans, tensors)}


def _arch_spec(gguf: GGUFFile) -> ArchSpec:
    if gguf.architecture not in ARCHITECTURES:
        raise ValueError(
            f"model: {gguf.path} has architecture {gguf.architecture!r}; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[gguf.architecture]


def _plan(gguf: GGUFFile, spec: ArchSpec) -> list[_TensorPlan]:
    plans = []
    for name, info in gguf.tensors.items():
        if name in spec.ignored:
            continue
        hf_name = spec.hf_name(name)
        if hf_name is None:
            raise ValueError(
                f"model: {gguf.path}: tensor {name!r} has no Hugging Face name for "
                f"architecture {gguf.architecture!r}"
            )
        plans.append(_TensorPlan(info, hf_name, tuple(spec.transforms_for(name))))
    # Largest first, so the thread pool does not end on one big tensor.
    return sorted(plans, key=lambda plan: -plan.info.num_bytes)


def _load_tensor(gguf: GGUFFile, plan: _TensorPlan, config, dtype: torch.dtype) -> torch.Tensor:
    values = dequantize(gguf.raw_data(plan.info), plan.info.qtype)
    if not values.flags.writeable:  # F32 tensors come back as views of the read-only map
        values = values.copy()
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if tuple(tensor.shape) != plan.info.shape:
        raise ValueError(
            f"model: {gguf.path}: tensor {plan.info.name} dequantized to {tuple(tensor.shape)}, "
            f"expected {plan.info.shape}"
        )
    for name in plan.transforms:
        tensor = TRANSFORMS[name](tensor, config)
    return tensor.to(dtype).contiguous()
