"""Build and load the fused elementwise kernels (C++ through ``torch.utils.cpp_extension``).

Built like the attention kernels (``sparsekv.attention.cpu.build``), as a separate extension
with its own cache folder: ``SPARSEKV_EXT_DIR`` (default ``~/.cache/sparsekv/ext``), then
``fused-<torch>-<python>-<digest of csrc/ and the flags>``. Models call :func:`load_extension`
when they are built, so a request never waits for the compiler; ``python -m
sparsekv.models.fused.build`` builds at install time.

``SPARSEKV_DISABLE_NATIVE=1`` turns these kernels off with the attention kernels,
``SPARSEKV_DISABLE_FUSED_OPS=1`` only these (to measure them). A failed build warns once and the
callers fall back to the eager PyTorch code (``fused/reference.py``).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from sparsekv.attention.cpu.build import native_disabled
from sparsekv.env_flags import switched_on
from sparsekv.ext_cache import cache_folder, compile_operators

EXTENSION_NAME = "sparsekv_fused_ops"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "binding.cpp",
    "isa_avx512.cpp",
    "isa_avx2.cpp",
    "isa_generic.cpp",
    "gemv_avx512bf16.cpp",
    "gemm_amx_bf16.cpp",
)
# -ffp-contract=off: no fused multiply-adds, so products round where eager PyTorch's do.
# -fopenmp: at::parallel_for is a header template over OpenMP in PyTorch's CPU builds; without
# the flag its pragma is ignored and every call runs on one thread.
EXTRA_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi")
EXTRA_LDFLAGS = ("-fopenmp",)
DISABLE_ENV = "SPARSEKV_DISABLE_FUSED_OPS"

_build_lock = threading.Lock()


def fused_disabled() -> bool:
    """True when ``SPARSEKV_DISABLE_NATIVE`` or ``SPARSEKV_DISABLE_FUSED_OPS`` is set true."""
    return switched_on(DISABLE_ENV) or native_disabled()


def build_directory() -> Path:
    """Cache folder of the compiled extension (``ext_cache.cache_folder``): one per torch and
    Python version and version of the sources and flags."""
    return cache_folder("fused-", CSRC_DIR, EXTRA_CFLAGS, EXTRA_LDFLAGS)


def _registered() -> bool:
    """Whether this process has loaded the operators already."""
    try:
        torch.ops.sparsekv_fused.available_isas  # noqa: B018 - raises when not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def compile_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reload from the cache) the extension and return its operator namespace
    ``torch.ops.sparsekv_fused``; raises on any build error.

    Loads at most one library per process: a second library (e.g. rebuilt after the sources
    changed) would register the namespace again, which aborts the process.
    """
    if _registered():
        return torch.ops.sparsekv_fused
    compile_operators(
        EXTENSION_NAME, CSRC_DIR, SOURCES, EXTRA_CFLAGS, EXTRA_LDFLAGS, build_directory(), verbose
    )
    return torch.ops.sparsekv_fused


@functools.cache
def _load_once() -> ModuleType | None:
    # Cached for the process: the compiled module is immutable, and a failure is reported once.
    try:
        return compile_extension()
    except Exception as exc:  # noqa: BLE001 - any build problem means "use the eager code"
        warnings.warn(
            f"sparsekv fused CPU ops unavailable ({type(exc).__name__}: {exc}); "
            "falling back to eager PyTorch",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def load_extension() -> ModuleType | None:
    """The fused operators (``torch.ops.sparsekv_fused``), building them on first use; ``None``
    if disabled or the build failed. Thread-safe."""
    if fused_disabled():
        return None
    with _build_lock:
        return _load_once()


def main() -> None:
    """Build the extension now and print where it lives and how long it took."""
    start = time.perf_counter()
    ops = compile_extension(verbose="-v" in sys.argv[1:])
    elapsed = time.perf_counter() - start
    print(f"{EXTENSION_NAME}: built or loaded from {build_directory()} in {elapsed:.1f} s")
    print("variants on this CPU:", ops.available_isas())


if __name__ == "__main__":
    main()
