"""The Triton kernel modules for tests: interpreted on CPU tensors, compiled on a GPU.

Triton decides whether a ``triton.jit`` function runs under its interpreter when the function
is defined, from ``TRITON_INTERPRET``; that includes ``triton.language``'s own reductions,
defined when ``triton`` is first imported. :func:`load` therefore sets the variable, imports
``triton`` and the kernel modules (dropping copies imported earlier without it, e.g. by
``torch._dynamo``), and restores the variable; Triton also reads it while launching, so
each Triton test sets it again for its own duration (the autouse fixture
:func:`triton_mode`, imported by the test modules). ``tests/conftest.py`` also sets it for the
whole CPU session, so that a library importing ``triton`` first (``torch._dynamo``, Ray) gets
the interpreted definitions; Triton's compiled extension is never dropped (it cannot be
imported twice). With
``SPARSEKV_TEST_DEVICE=cuda`` (the GPU check script) nothing is interpreted: the kernels
compile for the GPU and the tests run on CUDA tensors.

Without ``triton`` installed (CI installs the ``gpu`` extra) the Triton tests fail at
collection instead of skipping.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest
import torch

# Dependency order: each module is imported after the ones it takes names from.
MODULES = (
    "common",
    "decode_mass",
    "decode_splits",
    "decode",
    "prefill",
    "prefill_paged",
    "window_scores",
    "kv_write",
)
PACKAGE = "sparsekv.attention.triton"

DEVICE = torch.device(os.environ.get("SPARSEKV_TEST_DEVICE", "cpu"))
FP32_TOL = {"atol": 1e-5, "rtol": 0.0}
FP16_TOL = {"atol": 2e-3, "rtol": 2e-3}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}  # the project's bf16 kernel tolerance
# The interpreter's bf16 arithmetic is not the GPU's: bf16 is tested on a GPU only.
DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances of a kernel run in ``dtype`` against the fp32 reference."""
    return {torch.float32: FP32_TOL, torch.float16: FP16_TOL, torch.bfloat16: BF16_TOL}[dtype]


def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sys.modules["triton.language"].standard.sum, InterpretedFunction)


def load() -> types.SimpleNamespace:
    """The kernel modules, defined for :data:`DEVICE` (interpreted on the CPU)."""
    interpret = DEVICE.type == "cpu"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        stale_triton = "triton" in sys.modules and _interpreting() != interpret
        common = sys.modules.get(f"{PACKAGE}.common")
        stale = stale_triton or (common is not None and common.INTERPRETED != interpret)
        for name in list(sys.modules):
            # Triton's compiled extension (``triton._C``) cannot be imported twice: its entries stay.
            python_part = name.split(".")[0] == "triton" and not name.startswith("triton._C")
            if (stale_triton and python_part) or (stale and name.startswith(PACKAGE + ".")):
                del sys.modules[name]
        import triton  # noqa: F401  (fails loudly where the extra is missing)

        modules = {name: importlib.import_module(f"{PACKAGE}.{name}") for name in MODULES}
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    assert _interpreting() == interpret and modules["common"].INTERPRETED == interpret
    return types.SimpleNamespace(**modules)


@pytest.fixture(autouse=True)
def triton_mode(monkeypatch):
    """``TRITON_INTERPRET`` for the duration of one Triton test (launches read it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if DEVICE.type == "cpu" else "0")


def backend():
    """A ``TritonBackend`` whose kernels run on :data:`DEVICE` (interpreted on the CPU), for
    suites that run every backend on the same cases; they need :func:`triton_mode` active."""
    load()
    return importlib.import_module("sparsekv.attention.backends.triton_backend").TritonBackend()
