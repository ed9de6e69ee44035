"""The attention-backend interface: every attention, scoring and page-copy operation the engine
runs, behind one object chosen once at engine start and passed down.

Storage (``kv_cache.storage``), scoring (``compression``), compaction and the paged-attention
step context receive an ``AttentionBackend``; none of them imports a kernel. Implementations:
``TorchBackend`` (plain PyTorch, any device: the oracle), ``CpuNativeBackend`` (the C++ CPU
kernels, falling back to ``TorchBackend`` where they do not take the tensors) and, where Triton
is installed, a Triton backend (``backends.BACKENDS``).

Page layout (docs/design.md, "KV memory"): one pool tensor ``[num_pages, 2 (K, V),
num_kv_heads, block_size, head_dim]``; a (request, layer) owns a block table of page ids, and
its logical slot ``s`` lives in page ``block_table[(s - first_slot) // block_size]`` at offset
``s % block_size`` (``first_slot`` is a multiple of ``block_size``). Query head ``h`` reads KV
head ``h // (num_heads // num_kv_heads)`` (GQA). Every log-sum-exp is the natural log in fp32.

Capability checks (``supports_*``) say whether an optional fast route takes the given tensors;
callers that get ``False`` take a generic route built from the required operations (for example
a quantized pool is dequantized page by page and decoded with ``paged_decode``).

The operations come in groups, one base class each, that ``AttentionBackend`` combines:
``DecodeOps`` (``decode_ops``: paged decode), ``PrefillOps`` (``prefill_ops``: prompt and chunk
attention), ``ScoringOps`` (``scoring_ops``: window scores, top-``k`` selection) and
``WriteOps`` (``write_ops``: KV writes and compaction copies; ``decode_ops`` also holds
``DecodeParams`` and ``DecodeResult``). This module adds the backend's lifecycle and its page
allocation.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch

from sparsekv.attention.backends.decode_ops import DecodeOps, DecodeParams, DecodeResult
from sparsekv.attention.backends.prefill_ops import PrefillOps
from sparsekv.attention.backends.scoring_ops import ScoringOps
from sparsekv.attention.backends.write_ops import WriteOps
from sparsekv.attention.cpu.memory import advise_huge_pages

__all__ = ["AttentionBackend", "DecodeParams", "DecodeResult"]


class AttentionBackend(DecodeOps, PrefillOps, ScoringOps, WriteOps):
    """One platform's attention kernels (class attribute ``name``: the ``--attention-backend``
    value that selects it).

    Tensor conventions: ``query`` ``[batch, num_heads, head_dim]`` for decode, ``[num_heads,
    num_queries, head_dim]`` for prefill and scoring; keys and values ``[num_kv_heads, n,
    head_dim]``; pools as in the module docstring. Compute dtypes are fp32, bf16 and fp16;
    accumulation and every LSE / score / mass output is fp32.

    The operations are inherited from the groups ``DecodeOps``, ``PrefillOps``, ``ScoringOps``
    and ``WriteOps``; an implementation subclasses this class and overrides every abstract
    operation (and the optional ones it has kernels for).
    """

    name: ClassVar[str] = ""

    def prepare(self) -> bool:
        """Build or load this backend's kernels now (engine start, never on a request).

        Returns:
            True when the backend's own kernels are usable; False when it will run its
            fallbacks only (it still works).
        """
        return True

    def allocate_pages(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed tensor for KV pages (codes, scales).

        On CPU (Linux) the memory is advised for transparent 2 MiB pages
        (``attention.cpu.memory``) before it is zeroed: decode reads pages in block-table
        order, scattered over the pool, and with 4 KiB pages most of those reads also miss the
        TLB. The advice takes on memory not yet touched: a pool-sized tensor gets a fresh
        mapping; a small one (below glibc's mmap threshold, 32 MiB once the engine tunes the
        allocator) may reuse heap pages, which stay 4 KiB until the kernel collapses them.
        Elsewhere it is a plain ``torch.zeros``.

        Args:
            shape: the tensor's shape (e.g. ``[num_pages, 2, num_kv_heads, block_size,
                head_dim]`` for plain pages).
            dtype: its element type (compute dtype, codes or scales).
            device: where the pages live.

        Returns:
            A contiguous zero tensor of ``shape`` and ``dtype`` on ``device``.
        """
        device = torch.device(device)
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        tensor = torch.empty(shape, dtype=dtype, device=device)
        advise_huge_pages(tensor)
        return tensor.zero_()

    def step_scope(self) -> contextlib.AbstractContextManager:
        """A context manager around one step's forward within which the backend may resolve
        once what its kernels otherwise check per call (build state, a variant forced through
        the environment). The CPU backend resolves its paged-decode kernels there; prefill,
        chunk and window-score kernels still check per call. The default resolves nothing."""
        return contextlib.nullcontext()
