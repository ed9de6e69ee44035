"""One scope around a step's forward: the native kernels' build and variant checks once.

The fused model ops, the packed-weight matmuls and the attention backend's kernels each check
their extension and ``SPARSEKV_KERNEL_ISA`` per call unless a scope resolved them; a decode step
calls them a few hundred times, so every forward of the model (a scheduled step, a static decode
bucket, a self-draft position) runs inside :func:`step_kernels`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.models.fused import ops as fused
from sparsekv.models.quant import ops as quant_ops


@contextlib.contextmanager
def step_kernels(backend: AttentionBackend) -> Iterator[None]:
    """The fused ops', packed matmuls' and ``backend``'s kernel checks resolved once for the
    block (each restored on exit, exceptions included)."""
    with fused.native_scope(), quant_ops.native_scope(), backend.step_scope():
        yield
