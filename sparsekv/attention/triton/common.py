"""Launch helpers shared by the Triton kernel modules: tile sizes and device checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

MIN_DOT = 16  # tl.dot needs at least 16 rows and columns on GPUs
# ``triton.jit`` reads TRITON_INTERPRET when a kernel is defined: the kernel modules, which
# import this one first, run under the interpreter exactly when this was true at import.
INTERPRETED = bool(knobs.runtime.interpret)


def interpreted() -> bool:
    """True when this package's kernels were defined under Triton's interpreter."""
    return INTERPRETED


def check_device(*tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the tensors share one device a kernel can run on: CUDA, or
    the CPU under the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors must share one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreted():
        raise ValueError(
            "device: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
        )


def dot_rows(count: int) -> int:
    """Rows of a ``tl.dot`` tile holding ``count`` rows: a power of two, at least 16."""
    return max(MIN_DOT, triton.next_power_of_2(max(count, 1)))


def pool_strides(pool: torch.Tensor) -> tuple[int, int, int, int]:
    """Strides (page, K/V, head, slot) of a ``[num_pages, 2, num_kv_heads, block_size,
    head_dim]`` pool whose last dimension has unit stride.

    Raises:
        ValueError: the pool is not 5-D or its last stride is not 1.
    """
    if pool.dim() != 5 or pool.stride(-1) != 1:
        raise ValueError(
            "kv_pool must be [num_pages, 2, num_kv_heads, block_size, head_dim] with unit "
            f"last stride, got shape {tuple(pool.shape)} strides {pool.stride()}"
        )
    return pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3)


@triton.jit
def softcap(logits, cap):
    """``cap * tanh(logits / cap)`` in fp32 (tanh from one exponential, stable both ways)."""
    x = logits / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)
