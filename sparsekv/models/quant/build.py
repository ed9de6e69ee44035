"""Build and load the packed-weight kernels (C++ through ``torch.utils.cpp_extension``).

Built like the fused ops (``sparsekv.models.fused.build``), as a separate extension with its
own cache folder ``quant-<torch>-<python>-<digest of csrc/ and the flags>`` under
``SPARSEKV_EXT_DIR`` (default ``~/.cache/sparsekv/ext``). ``SPARSEKV_DISABLE_NATIVE=1`` turns
them off with the other native kernels; packed linears then dequantize in PyTorch
(``formats.dequantize_reference``). A failed build warns once and falls back the same way.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from sparsekv.attention.cpu.build import native_disabled
from sparsekv.ext_cache import cache_folder, compile_operators

EXTENSION_NAME = "sparsekv_quant_ops"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "binding.cpp",
    "int8_rows_binding.cpp",
    "isa_avx512_amx.cpp",
    "isa_avx512_vnni.cpp",
    "isa_avx512_bf16.cpp",
    "isa_avx2.cpp",
    "isa_generic.cpp",
)
# -ffp-contract=fast: a * b + c becomes one fused multiply-add in the AVX2 variant (ISO C++
# mode turns contraction off by default). -fopenmp: at::parallel_for runs on OpenMP.
EXTRA_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi")
EXTRA_LDFLAGS = ("-fopenmp",)

_build_lock = threading.Lock()


def build_directory() -> Path:
    """Cache folder of the compiled extension (``ext_cache.cache_folder``): one per torch and
    Python version and version of the sources and flags."""
    return cache_folder("quant-", CSRC_DIR, EXTRA_CFLAGS, EXTRA_LDFLAGS)


def compile_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reload from the cache) the extension and return ``torch.ops.sparsekv_quant``;
    raises on any build error. Loads at most one library per process."""
    try:
        torch.ops.sparsekv_quant.available_isas  # noqa: B018 - raises when not registered
        return torch.ops.sparsekv_quant
    except (AttributeError, RuntimeError):
        pass
    compile_operators(
        EXTENSION_NAME, CSRC_DIR, SOURCES, EXTRA_CFLAGS, EXTRA_LDFLAGS, build_directory(), verbose
    )
    return torch.ops.sparsekv_quant


@functools.cache
def _load_once() -> ModuleType | None:
    try:
        return compile_extension()
    except Exception as exc:  # noqa: BLE001 - any build problem means "dequantize in PyTorch"
        warnings.warn(
            f"sparsekv packed-weight kernels unavailable ({type(exc).__name__}: {exc}); "
            "packed linears dequantize in PyTorch",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def load_extension() -> ModuleType | None:
    """``torch.ops.sparsekv_quant``, building it on first use; ``None`` if native kernels are
    disabled or the build failed. Thread-safe."""
    if native_disabled():
        return None
    with _build_lock:
        return _load_once()


def is_loaded() -> bool:
    """Whether :func:`load_extension` has already built, loaded or failed to build the
    extension in this process (so calling it now costs no build)."""
    return _load_once.cache_info().currsize > 0


if __name__ == "__main__":
    print(
        "packed-weight kernel variants on this CPU:",
        compile_extension("-v" in sys.argv).available_isas(),
    )
