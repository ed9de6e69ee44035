"""Keep glibc's allocator from returning large freed blocks to the kernel between steps.

A prefill step allocates activations of tens of MB (SmolLM2, 4096 tokens: gate_up is
[4096, 3072] bf16 = 24 MiB) and frees them a few milliseconds later. glibc serves a block above
its mmap threshold (128 KiB to start, raised by itself up to 32 MiB as it sees blocks freed) with
a fresh ``mmap`` and unmaps it on ``free``, and trims freed memory above 128 KiB at the top of
the heap: the next step then page-faults every 4 KiB page of the same sizes again (the kernel
zeroes each one). Measured on the 2-core test VM, S1 (16 x 2000 tokens, 128 out): prefill steps
take ~0.92 s instead of ~1.23 s (14.8 s instead of 17.0 s in all, sys time halved) when both
thresholds are raised once at start, which is ``mallopt``'s documented use (``man 3 mallopt``).
The same cost is why vLLM's and Intel's CPU guides preload tcmalloc or jemalloc; this needs no preload.

Both thresholds act on glibc's main arena only. A thread other than the main one gets an arena
of its own, built from 64 MiB mmapped heaps that are unmapped as soon as they are empty: there
every prefill-sized block is mapped and faulted afresh, whatever the thresholds say. The server
steps its engine in such a thread (``engine.async_engine``), so the arena count is also capped
at one (``M_ARENA_MAX``): every thread then allocates from the main arena and keeps its freed
blocks. Measured on a 2-core AMD EPYC (AVX2) VM: a step-like pattern of 3-24 MiB blocks faults
61k pages per 10 rounds in a second thread with the thresholds alone, 0 with the cap (0 in the
main thread either way); SmolLM2 fp32, one 4000-token prefill stepped in a second thread:
423-454k minor faults without the cap or with it set after other threads had allocated, 29k
with it set first. The cap must come before other threads allocate (a thread keeps the arena
it first got), so ``sparsekv serve`` tunes the allocator first thing.

The tuning is skipped where the C library is not glibc, where the user already set glibc's own
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, where another allocator is preloaded
(``LD_PRELOAD``), and when ``SPARSEKV_MALLOC_TUNING=0``; a ``MALLOC_ARENA_MAX`` of the user's
leaves the arena count alone.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (glibc <malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

# Blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit hosts) come from the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
# Freed memory kept at the top of the heap before trimming: a few steps' activations.
TRIM_THRESHOLD_BYTES = 512 << 20

_tuned: bool | None = None


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds and cap its arenas at one for this process (once;
    later calls return the first answer).

    Returns:
        True when they were set; False when skipped (not glibc, tuned by the user,
        another allocator preloaded, ``SPARSEKV_MALLOC_TUNING=0``) or refused by ``mallopt``.
    """
    global _tuned
    if _tuned is None:
        _tuned = _tune()
    return _tuned


def _tune() -> bool:
    if os.environ.get("SPARSEKV_MALLOC_TUNING", "1") == "0":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc")):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    ok = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and ok
    if "MALLOC_ARENA_MAX" not in os.environ:  # the user's own arena count stays
        ok = bool(mallopt(M_ARENA_MAX, 1)) and ok
    if ok:
        logger.info(
            "glibc malloc: one arena, blocks up to %d MiB from the heap, trimmed above %d MiB",
            MMAP_THRESHOLD_BYTES >> 20,
            TRIM_THRESHOLD_BYTES >> 20,
        )
    return ok
