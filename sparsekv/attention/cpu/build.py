"""Build and load the native CPU kernels (C++ through ``torch.utils.cpp_extension``).

The extension is compiled once per machine into a cache folder (``SPARSEKV_EXT_DIR``, default
``~/.cache/sparsekv/ext``, then ``<torch>-<python>-<digest of csrc/ and the flags>``) and
reloaded from there afterwards; the engine calls :func:`load_extension` at start so a request
never waits for a compiler. Run ``python -m sparsekv.attention.cpu.build`` to build at install
time. The digest gives every version of the sources its own folder: checkouts or snapshots of
different versions on one machine would otherwise rebuild over each other's library, and a
process could load a library built from other sources.

``SPARSEKV_DISABLE_NATIVE=1`` turns the kernels off; a failed build warns once and the callers
fall back to the plain-PyTorch reference (``attention/torch_ref.py``).
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

from sparsekv.env_flags import switched_on
from sparsekv.ext_cache import cache_folder, compile_operators

EXTENSION_NAME = "sparsekv_cpu_kernels"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = (  # headers: tracked by ninja, and part of the build folder's digest
    "binding.cpp",
    "window_fused_binding.cpp",
    "compaction_binding.cpp",
    "prefill_binding.cpp",
    "chunk_paged_binding.cpp",
    "chunk_paged_avx512_amx.cpp",
    "chunk_paged_avx512_bf16.cpp",
    "chunk_paged_avx512.cpp",
    "chunk_paged_avx2.cpp",
    "chunk_paged_generic.cpp",
    "isa_select.cpp",
    "isa_avx512_amx.cpp",
    "isa_avx512_bf16.cpp",
    "isa_avx512.cpp",
    "isa_avx2.cpp",
    "isa_avx2_w16.cpp",
    "isa_generic.cpp",
)
# -ffp-contract=fast lets `a += b * c` on vectors become one FMA (ISO C++ mode turns it off).
EXTRA_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi"]
EXTRA_LDFLAGS = ["-fopenmp"]

_build_lock = threading.Lock()


def native_disabled() -> bool:
    """True when ``SPARSEKV_DISABLE_NATIVE`` is set to a true value (1, true, yes, on)."""
    return switched_on("SPARSEKV_DISABLE_NATIVE")


def build_directory() -> Path:
    """Cache folder of the compiled extension (``ext_cache.cache_folder``): one per torch and
    Python version and version of the sources and flags."""
    return cache_folder("", CSRC_DIR, EXTRA_CFLAGS, EXTRA_LDFLAGS)


def compile_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reload from the cache) the extension and return its operator namespace
    ``torch.ops.sparsekv_cpu``; raises on any build error."""
    compile_operators(
        EXTENSION_NAME, CSRC_DIR, SOURCES, EXTRA_CFLAGS, EXTRA_LDFLAGS, build_directory(), verbose
    )
    return torch.ops.sparsekv_cpu


@functools.cache
def _load_once() -> ModuleType | None:
    # Cached for the process: the compiled module is immutable, and a failure is reported once.
    try:
        return compile_extension()
    except Exception as exc:  # noqa: BLE001 - any build problem means "use the reference"
        warnings.warn(
            f"sparsekv native CPU kernels unavailable ({type(exc).__name__}: {exc}); "
            "falling back to the PyTorch reference attention",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def load_extension() -> ModuleType | None:
    """The kernel operators (``torch.ops.sparsekv_cpu``), building them on first use; ``None``
    if disabled or the build failed.

    Thread-safe: concurrent first callers wait for one build (processes sharing the cache folder
    are serialised by ``cpp_extension``'s lock file).
    """
    if native_disabled():
        return None
    with _build_lock:
        return _load_once()


def main() -> None:
    """Build the extension now and print where it lives and how long it took."""
    start = time.perf_counter()
    ops = compile_extension(verbose="-v" in sys.argv[1:])
    elapsed = time.perf_counter() - start
    print(f"{EXTENSION_NAME}: built or loaded from {build_directory()} in {elapsed:.1f} s")
    print("kernel variants on this CPU:", ops.available_isas())
    print("prefill kernel variants:", ops.prefill_isas())
    print("AMX:", ops.amx_status())


if __name__ == "__main__":
    main()
