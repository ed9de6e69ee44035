"""Transparent huge pages for KV page pools (Linux).

Decode reads pages in block-table order, which is random in memory: with 4 KiB pages nearly
every KV page read also misses the TLB. Asking for 2 MiB pages (``madvise(MADV_HUGEPAGE)``,
honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``)
removes most of those misses. The advice applies to pages faulted in afterwards, so it is given
on a freshly allocated, untouched tensor (``torch.empty``) before it is filled:
``AttentionBackend.allocate_pages`` does so for every storage's pool, and the kernel benchmark
for its synthetic pools.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_page_setting(path: str = THP_SETTING) -> str | None:
    """The kernel's transparent huge page mode: ``"always"``, ``"madvise"`` or ``"never"`` (the
    bracketed word of ``path``), or ``None`` where the file is missing or unreadable (not
    Linux, or a kernel without THP). The advice of :func:`advise_huge_pages` takes under
    ``always`` and ``madvise``."""
    try:
        with open(path, encoding="ascii") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError):
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Advise the kernel to back ``tensor``'s memory with huge pages; True if it accepted.

    Only the 2 MiB-aligned part of the tensor is advised. Returns False on other platforms, for
    non-CPU or small tensors, or when the call fails; never raises.
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned_start = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    aligned_end = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if aligned_end <= aligned_start:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(aligned_start, aligned_end - aligned_start, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
