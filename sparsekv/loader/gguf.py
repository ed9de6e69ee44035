"""Load a GGUF checkpoint as a Hugging Face state dict, config and tokenizer.

Tensors are dequantized with ``gguf.quants.dequantize`` (exactly what transformers' own GGUF
loader does), renamed with :mod:`sparsekv.loader.name_maps` and fixed up with
:mod:`sparsekv.loader.transforms`, so the result loads into the transformers model of the
same family unchanged.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf.quants import dequantize

from sparsekv.loader.gguf_config import complete_config
from sparsekv.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf
from sparsekv.loader.gguf_metadata import load_gguf_config_and_tokenizer
from sparsekv.loader.name_maps import ARCHITECTURES, ArchSpec
from sparsekv.loader.transforms import TRANSFORMS

_CHUNK_VALUES = 1 << 22  # values per dequantization work unit (16 MiB in float32)


@dataclass(frozen=True)
class _TensorPlan:
    info: GGUFTensorInfo
    hf_name: str
    transforms: tuple[str, ...]


def load_gguf(path: str | Path, dtype: torch.dtype):
    """Read a GGUF file into ``(hf_config, tokenizer, state_dict)``.

    Args:
        path: the ``.gguf`` file (architectures: those of
            :data:`sparsekv.loader.name_maps.ARCHITECTURES`).
        dtype: floating dtype of the returned tensors (gguf dequantizes to float32; cast after).

    Returns:
        ``(hf_config, tokenizer, state_dict)``; see :func:`gguf_state_dict` for the tensors.

    Raises:
        ValueError: (message starts with ``model:``) the file is missing or malformed, or its
            architecture or a tensor name is not supported.
    """
    gguf = read_gguf(path)
    spec = _arch_spec(gguf)
    config, tokenizer = load_gguf_config_and_tokenizer(gguf)
    config = complete_config(gguf, config)
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
    # Tensors needing a transform are dequantized in float32 first; the rest go straight to
    # ``dtype``, so bf16 loads never hold a float32 copy of the big embedding.
    outputs = {
        plan.hf_name: torch.empty(
            plan.info.shape, dtype=torch.float32 if plan.transforms else dtype
        )
        for plan in plans
    }
    units = [(plan, rows) for plan in plans for rows in _row_chunks(plan.info.shape)]
    # Row chunks spread big tensors over the workers; numpy's dequantization and torch's copies
    # release the GIL for most of their work.
    num_workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(num_workers) as pool:
        for _ in pool.map(lambda unit: _dequantize_rows(gguf, *unit, outputs), units):
            pass
    state_dict = {}
    for plan in plans:
        tensor = outputs.pop(plan.hf_name)
        for name in plan.transforms:
            tensor = TRANSFORMS[name](tensor, config)
        state_dict[plan.hf_name] = tensor.to(dtype).contiguous()
    return state_dict


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
    return plans


def _row_chunks(shape: tuple[int, ...]) -> list[slice]:
    if len(shape) == 1:
        return [slice(0, shape[0])]
    rows_per_chunk = max(1, _CHUNK_VALUES // math.prod(shape[1:]))
    return [slice(start, start + rows_per_chunk) for start in range(0, shape[0], rows_per_chunk)]


def _dequantize_rows(
    gguf: GGUFFile, plan: _TensorPlan, rows: slice, outputs: dict[str, torch.Tensor]
) -> None:
    info = plan.info
    raw = gguf.raw_data(info)
    values = dequantize(raw if len(info.shape) == 1 else raw[rows], info.qtype)
    target = outputs[plan.hf_name][rows]
    if values.shape != target.shape:
        raise ValueError(
            f"model: {gguf.path}: tensor {info.name} rows {rows.start}:{rows.stop} dequantized "
            f"to {values.shape}, expected {tuple(target.shape)}"
        )
    # from_numpy warns on read-only arrays (F32 data is a view of the read-only map).
    target.copy_(torch.from_numpy(values if values.flags.writeable else values.copy()))
