"""Value fixes that turn llama.cpp's stored tensors back into Hugging Face's convention.

Each transform takes a float32 tensor in PyTorch layout and the HF config and returns the
tensor HF's model expects. The table :data:`TRANSFORMS` is indexed by the names used in
:data:`sparsekv.loader.name_maps.ARCHITECTURES`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for one projection.

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders each head's rows from
    HF's half-split RoPE layout ``[2, head_dim / 2]`` to the interleaved ``[head_dim / 2, 2]``
    layout of GPT-J style RoPE. This is the inverse (transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``).

    Args:
        weight: ``[num_heads * head_dim, hidden_size]`` as stored in the GGUF file.
        num_heads: query heads for ``q_proj``, KV heads for ``k_proj``.

    Returns:
        ``[num_heads * head_dim, hidden_size]`` in HF row order (contiguous).
    """
    rows, *rest = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _unpermute_q(weight: torch.Tensor, config) -> torch.Tensor:
    return unpermute_rows(weight, config.num_attention_heads)


def _unpermute_k(weight: torch.Tensor, config) -> torch.Tensor:
    return unpermute_rows(weight, config.num_key_value_heads)


def _subtract_one(weight: torch.Tensor, config) -> torch.Tensor:
    # llama.cpp folds Gemma's ``x * (1 + w)`` RMSNorm into ``x * w'`` with w' = 1 + w;
    # HF's Gemma3RMSNorm applies the ``1 +`` itself, so store w = w' - 1.
    return weight - 1.0


# Transforms that only reorder rows: they apply to packed rows of bytes as well.
ROW_PERMUTATIONS = frozenset({"unpermute_q", "unpermute_k"})

TRANSFORMS: dict[str, Callable[[torch.Tensor, object], torch.Tensor]] = {
    "unpermute_q": _unpermute_q,
    "unpermute_k": _unpermute_k,
    "subtract_one": _subtract_one,
}
