"""Release the calling thread's OpenMP worker threads (GNU libgomp, which PyTorch's Linux x86-64
wheels use), so that an engine stepping in another thread keeps libgomp's full spin-wait.

libgomp keeps a pool of worker threads per thread that has started a parallel region, and
counts every pool's threads. While that count exceeds the CPUs, every idle worker spins only
~100 iterations before sleeping on a futex (its "throttled" spin count) instead of ~300000,
so each of the thousands of parallel regions of a step pays a wake-up. A server loads the
model in its main thread (one pool) and steps the engine in a loop thread (a second pool): on
2 CPUs that is 3 counted threads, and the loop thread's steps are slower than the main
thread's (docs/internals.md, Engine). ``omp_pause_resource_all`` (OpenMP 5.0) frees the
runtime's resources; the standard leaves its scope to the implementation, and libgomp's ends
only the calling thread's pool and takes its threads off the count. A later parallel region
in that thread starts a new pool (and the throttle comes back while it lives).

``SPARSEKV_OMP_POOL_RELEASE=0`` (or ``false``, ``off``, ``no``) turns the release off. It is also off in a forked child:
libgomp does not survive fork, and releasing a pool whose workers stayed in the parent would
wait for them forever.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from sparsekv.env_flags import switched_off

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep the runtime initialised
RELEASE_ENV = "SPARSEKV_OMP_POOL_RELEASE"
LIBGOMP = "libgomp.so.1"  # the soname; renamed copies are found in /proc/self/maps

_forked_child = False


def _mark_forked_child() -> None:
    global _forked_child
    _forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked_child)


def loaded_libgomp() -> str | None:
    """Path of the libgomp this process has loaded (PyTorch's, possibly renamed, e.g.
    ``libgomp-<hash>.so.1``), from ``/proc/self/maps``; ``None`` where none is loaded or the
    file cannot be read (not Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp"):
            return fields[5]
    return None


def release_thread_pool() -> bool:
    """End the OpenMP worker pool of the calling thread, if PyTorch's libgomp is loaded.

    Call it from the thread that loaded the model once it hands all torch work to another
    thread, outside any parallel region. Only a libgomp already in the process is used
    (``RTLD_NOLOAD``); with another OpenMP runtime (Intel's libiomp5, LLVM's libomp) or none,
    nothing happens.

    Returns:
        True when libgomp ended the pool (or the thread had none); False where no libgomp is
        loaded, it lacks ``omp_pause_resource_all`` (GCC < 9), it refused (inside a parallel
        region), this is a forked child, or ``SPARSEKV_OMP_POOL_RELEASE`` is off.
    """
    if _forked_child or switched_off(RELEASE_ENV):
        return False
    try:
        libgomp = ctypes.CDLL(loaded_libgomp() or LIBGOMP, mode=os.RTLD_NOLOAD)
        pause = libgomp.omp_pause_resource_all  # not omp_pause_resource: no device lookup
    except (OSError, AttributeError):
        logger.debug("no libgomp with omp_pause_resource_all loaded: pool left as it is")
        return False
    pause.argtypes, pause.restype = (ctypes.c_int,), ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
