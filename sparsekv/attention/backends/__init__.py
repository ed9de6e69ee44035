"""Attention backends: the name -> class table behind ``--attention-backend`` and the one place
that picks a backend (``create_backend``, called once at engine start).

Classes are named as ``"module:Class"`` strings and imported on selection, so a backend whose
dependency is missing (Triton) costs nothing until asked for, and fails then with a clear
``ValueError``.
"""

from __future__ import annotations

import importlib

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.attention.backends.decode_ops import DecodeParams, DecodeResult

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "AttentionBackend",
    "DecodeParams",
    "DecodeResult",
    "backend_class",
    "create_backend",
]

BACKENDS: dict[str, str] = {
    "cpu": "sparsekv.attention.backends.cpu_native:CpuNativeBackend",
    "torch": "sparsekv.attention.backends.torch_backend:TorchBackend",
    "triton": "sparsekv.attention.backends.triton_backend:TritonBackend",
}
BACKEND_NAMES = ("auto", *BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered under ``name`` in :data:`BACKENDS`.

    Raises:
        ValueError: an unknown name, or the backend cannot be imported here (its package,
            e.g. ``triton``, is not installed).
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    module_name, class_name = BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"attention_backend {name!r} is not available: {error} "
            "(install what it needs, e.g. `pip install triton==3.6.0` for triton: the `gpu` "
            "extra of the sparsekv checkout)"
        ) from error
    return getattr(module, class_name)


def create_backend(
    name: str, device: str | torch.device = "cpu", prefill_qk_dtype: str = "auto"
) -> AttentionBackend:
    """Build and prepare the backend for ``--attention-backend name`` on ``device``, with
    ``--prefill-qk-dtype`` (``int8`` sets ``prefill_qk_int8``).

    ``auto`` picks the native CPU kernels on a CPU device when they build (else the PyTorch
    reference, as ``SPARSEKV_DISABLE_NATIVE=1`` forces), and on an accelerator Triton when it
    imports (else the reference).

    Raises:
        ValueError: an unknown name, a backend that cannot run on ``device`` (``cpu`` off the
            CPU), one that cannot be imported, or a ``prefill_qk_dtype`` other than ``auto`` /
            ``int8``.
    """
    if prefill_qk_dtype not in ("auto", "int8"):
        raise ValueError(f"prefill_qk_dtype must be one of auto, int8, got {prefill_qk_dtype!r}")
    device = torch.device(device)
    if name == "auto":
        backend = _auto(device)
    else:
        backend = backend_class(name)()
        if name == "cpu" and device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on CPU tensors only, not on {device}")
        backend.prepare()
    backend.prefill_qk_int8 = prefill_qk_dtype == "int8"
    return backend


def _auto(device: torch.device) -> AttentionBackend:
    if device.type == "cpu":
        native = backend_class("cpu")()
        if native.prepare():
            return native
        return backend_class("torch")()
    try:
        backend = backend_class("triton")()
    except ValueError:
        return backend_class("torch")()
    backend.prepare()
    return backend
