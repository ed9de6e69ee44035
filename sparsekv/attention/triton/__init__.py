"""Triton kernels over the paged KV layout (the GPU attention backend).

One module per kernel family, each with the signature and semantics of its plain-PyTorch
oracle (``attention/torch_ref.py`` and the reference attention backend):

- ``decode``: paged decode attention (output, LSE, optional per-slot attention mass), GQA
  heads packed per KV head, split-KV merged by LSE, plain and int8 / fp8 pages;
- ``prefill``: causal attention with LSE for prompts and chunks (queries are the last keys),
  sliding window and soft-cap; PyTorch's flash kernel where it returns what is needed;
- ``window_scores``: SnapKV window scores over paged keys, LSE given or computed;
- ``kv_write``: KV write by slot mapping, kept-slot write and slot moves of compaction.

Importing a kernel module imports ``triton`` (the optional ``sparsekv[gpu]`` extra). The
kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before ``triton`` is first imported), which is how they are tested
without a GPU. :func:`is_available` says whether the package can be used at all.
"""

from __future__ import annotations

import importlib.util


def is_available() -> bool:
    """True when ``triton`` is installed (the kernels still need a CUDA device or the
    interpreter to run)."""
    return importlib.util.find_spec("triton") is not None
