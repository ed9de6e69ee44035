"""Release the calling thread's OpenMP worker threads (GNU libgomp, which PyTorch's CPU builds
use), so that an engine stepping in another thread keeps libgomp's full spin-wait.

libgomp keeps a pool of worker threads per thread that has started a parallel region, and
counts every pool's threads. While that count exceeds the CPUs, every idle worker spins only
~100 iterations before sleeping on a futex (its "throttled" spin count) instead of ~300000,
so each of the thousands of parallel regions of a prefill pays a wake-up. A server loads the
model in its main thread (one pool) and steps the engine in a loop thread (a second pool): on
2 CPUs that is 3 counted threads, and the loop thread's prefill is slower than the main
thread's (docs/internals.md, Engine). ``omp_pause_resource_all``
(OpenMP 5.0) ends the calling thread's pool and takes its threads off the count; a later
parallel region in that thread would start a new pool.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep the runtime initialised


def release_thread_pool() -> bool:
    """End the OpenMP worker pool of the calling thread, if PyTorch's libgomp is loaded.

    Call it from the thread that loaded the model once it hands all torch work to another
    thread, outside any parallel region. Only libgomp already in the process is used
    (``RTLD_NOLOAD``): with another OpenMP runtime (Intel's libiomp5, LLVM's libomp) or none,
    nothing happens.

    Returns:
        True when libgomp released the pool (or there was none); False where no libgomp is
        loaded, it lacks ``omp_pause_resource_all`` (GCC < 9), or it refused.
    """
    try:
        libgomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        pause = libgomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = (ctypes.c_int,), ctypes.c_int
    released = pause(OMP_PAUSE_SOFT) == 0
    if released:
        logger.debug("released this thread's OpenMP worker pool")
    return released
