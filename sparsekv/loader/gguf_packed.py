"""Keep a GGUF file's quantized linear weights packed instead of dequantizing them.

For ``--weight-dtype gguf``: every linear weight (``*_proj.weight``, ``lm_head.weight``, and the
token embedding, which a tied output head multiplies with) stored in a block format the native
kernels read (:data:`sparsekv.models.quant.formats.GGUF_FORMATS`) is copied out of the file as
its raw blocks, one row of bytes per output feature. llama.cpp's Q/K row permutation is undone
on those byte rows (a row permutation does not look inside a row). Everything else (norms, F32
/ F16 tensors, other quant types) stays in the dense state dict only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sparsekv.loader.gguf import _arch_spec, _plan
from sparsekv.loader.gguf_file import read_gguf
from sparsekv.loader.transforms import ROW_PERMUTATIONS, TRANSFORMS
from sparsekv.models.quant.formats import GGUF_FORMATS, PackedTensor

# The tensor a tied output head reuses.
EMBEDDING = "model.embed_tokens.weight"


def is_linear_weight(hf_name: str) -> bool:
    """Whether ``hf_name`` is a weight some linear layer multiplies with."""
    return hf_name.endswith("_proj.weight") or hf_name in ("lm_head.weight", EMBEDDING)


def load_packed_weights(path: str | Path, hf_config) -> tuple[dict[str, PackedTensor], list[str]]:
    """The packable linear weights of a GGUF file, as raw blocks.

    Args:
        path: the ``.gguf`` file.
        hf_config: its HF config (head counts for the Q/K row un-permutation).

    Returns:
        ``(packed, dense)``: HF name -> :class:`PackedTensor` ``[out_features, in_features]``
        in HF row order; and ``"name (TYPE)"`` of the linear weights left dense (a block type
        the kernels do not read).

    Raises:
        ValueError: (message starts with ``model:``) as :func:`sparsekv.loader.gguf.load_gguf`.
    """
    gguf = read_gguf(path)
    packed, dense = {}, []
    for plan in _plan(gguf, _arch_spec(gguf)):
        if not is_linear_weight(plan.hf_name) or len(plan.info.shape) != 2:
            continue
        fmt = GGUF_FORMATS.get(plan.info.qtype.name)
        if fmt is None or not set(plan.transforms) <= ROW_PERMUTATIONS:
            dense.append(f"{plan.hf_name} ({plan.info.qtype.name})")
            continue
        # A copy: the file's map is read-only and closes with it.
        data = torch.from_numpy(np.array(gguf.raw_data(plan.info)))
        for name in plan.transforms:
            data = TRANSFORMS[name](data, hf_config)
        packed[plan.hf_name] = PackedTensor(fmt, plan.info.shape[1], data.contiguous())
    return packed, dense
