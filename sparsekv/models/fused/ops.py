"""Fused elementwise ops of the decoder layers: the native kernels (``csrc/``) where they apply,
else the eager code of ``reference.py``, with the same signatures and rounding.

The native kernels take CPU fp32 and bf16 tensors outside autograd (no tensor requiring grad
while grad mode is on) and compute in fp32, rounding to the input dtype where eager PyTorch
rounds (and fusing a multiply-add where PyTorch's AVX2 / AVX-512 kernels do). Against the eager
code on an AVX-512 or AVX2 CPU: residual sums and rotary results are bit-identical; the norms
differ only through the order of the fp32 sum of squares (~2e-7 relative in fp32, rarely 1 ulp
in bf16); SiLU and tanh-GELU use their own ~1-ulp fp32 ``exp`` instead of Sleef's (~2e-7
relative in fp32; on this project's Sapphire Rapids test machine the bf16 activation equals
eager's for every bf16 input, so ``act * up`` matches exactly; tests allow 1 ulp). In bf16 the
AVX-512 variant looks the activation up in a 65536-entry table that its own kernel computed on
first use (same results, ~1.7x faster than evaluating ``exp``: the GLU kernels are bound by their
instruction count, not by memory).
"""

from __future__ import annotations

import functools

import torch

from sparsekv.attention import paging
from sparsekv.env_flags import kernel_isa_setting
from sparsekv.models.fused import build, reference

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def prepare_fused_ops() -> bool:
    """Build or load the native kernels now (at model build, never on a request); True when
    they are usable."""
    return build.load_extension() is not None


class native_scope:
    """Within the ``with`` block, the fused ops use the extension resolved on entry instead of
    checking the environment and the build on every call (a model's forward calls them a few
    times per layer; those checks cost more than a decode-sized kernel). Reentrant."""

    __slots__ = ("_saved",)

    def __enter__(self) -> native_scope:
        global _scope_active, _scope_ext, _scope_isa
        self._saved = (_scope_active, _scope_ext, _scope_isa)
        _scope_ext = build.load_extension()
        _scope_isa = _variant_for(_scope_ext, kernel_isa_setting())
        _scope_active = True
        return self

    def __exit__(self, *exc) -> None:
        global _scope_active, _scope_ext, _scope_isa
        _scope_active, _scope_ext, _scope_isa = self._saved


_scope_active = False
_scope_ext = None
_scope_isa = ""


def fused_isa() -> str:
    """The variant the fused ops run now (``avx512``, ``avx2`` or ``generic``), ``""`` without
    the extension; see the module docstring for how ``SPARSEKV_KERNEL_ISA`` picks it."""
    ext = _extension()
    if ext is None:
        return ""
    return _variant() or str(ext.available_isas()).split(",")[0]


def _family(setting: str) -> str | None:
    """The fused-op variant a ``SPARSEKV_KERNEL_ISA`` setting (of any kernel family) names:
    ``avx512`` for every ``avx512*``, ``avx2`` for ``avx2*``, ``generic``; ``None`` for none."""
    for family in ("avx512", "avx2"):
        if setting.startswith(family):
            return family
    return "generic" if setting == "generic" else None


@functools.cache
def _variant_for(ext, setting: str) -> str:
    """The variant name passed to the kernels for a ``SPARSEKV_KERNEL_ISA`` setting: ``""``
    (the fastest) unless the setting caps it below what this CPU runs. Cached: outside a
    :class:`native_scope` every op asks."""
    family = _family(setting)
    if ext is None or family is None:
        return ""
    return family if family in str(ext.available_isas()).split(",") else ""


# Variant names (of any kernel family) at or above which the bf16 GEMV / small-M GEMM may run.
_GEMV_SETTINGS = ("avx512_bf16", "avx512_amx")
_SMALL_GEMM_SETTINGS = ("avx512_amx",)


def bf16_matmul_kernels_allowed() -> tuple[bool, bool]:
    """``(gemv, small_gemm)``: whether ``SPARSEKV_KERNEL_ISA`` lets the bf16 GEMV (needs
    AVX512-BF16) and small-M GEMM (needs AMX) run, where the CPU has them: both when unset or
    naming no variant; the GEMV for ``avx512_bf16`` and ``avx512_amx``; the GEMM for
    ``avx512_amx`` only. Read when a model's linears are prepacked."""
    setting = kernel_isa_setting()
    if _family(setting) is None:
        return True, True
    return setting in _GEMV_SETTINGS, setting in _SMALL_GEMM_SETTINGS


def _variant() -> str:
    """The enclosing :class:`native_scope`'s variant, else the environment's, read now."""
    return _scope_isa if _scope_active else _variant_for(_extension(), kernel_isa_setting())


def _extension():
    """The operator namespace (the one resolved by an enclosing :class:`native_scope`), or
    ``None`` when the extension is disabled or unavailable."""
    return _scope_ext if _scope_active else build.load_extension()


def _native(*tensors: torch.Tensor):
    """The operator namespace if the native kernels take ``tensors``, else ``None``."""
    ext = _extension()
    if ext is None:
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if not t.is_cpu or t.dtype not in NATIVE_DTYPES or (grad and t.requires_grad):
            return None
    return ext


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """RMS norm of the last dimension in fp32, cast back (``reference.rms_norm``).

    Args:
        x: ``[..., hidden_size]``; any strides (leading dimensions that do not collapse into two
            levels of strides are copied first).
        weight: ``[hidden_size]`` fp32 or bf16.
        eps: added to the mean square.
        unit_offset: scale by ``1 + weight`` (Gemma).

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype.
    """
    ext = _native(x, weight)
    if ext is None:
        return reference.rms_norm(x, weight, eps, unit_offset)
    return ext.rms_norm(x, weight, eps, unit_offset, _variant())


def add_rms_norm(
    hidden: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused with the next norm: ``(hidden + delta, rms_norm(hidden + delta))``,
    the sum rounded to ``hidden``'s dtype before the norm, as the eager two steps.

    Args:
        hidden, delta: ``[..., hidden_size]``, same shape and dtype.
        weight, eps, unit_offset: as :func:`rms_norm`.

    Returns:
        Two new tensors of ``hidden``'s shape and dtype.
    """
    ext = _native(hidden, delta, weight)
    if ext is None:
        return reference.add_rms_norm(hidden, delta, weight, eps, unit_offset)
    return ext.add_rms_norm(hidden, delta, weight, eps, unit_offset, _variant())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` of ``gate_up`` ``[..., 2 * n]`` (gate, then up) -> a new
    ``[..., n]``; any strides (rows that are not evenly strided are copied first)."""
    ext = _native(gate_up)
    if ext is None:
        return reference.silu_mul(gate_up)
    return ext.silu_mul(gate_up, _variant())


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (tanh GELU) with :func:`silu_mul`'s layout."""
    ext = _native(gate_up)
    if ext is None:
        return reference.gelu_tanh_mul(gate_up)
    return ext.gelu_tanh_mul(gate_up, _variant())


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` in place (``reference.apply_rotary``).

    ``x`` may be a strided view (e.g. the query and key heads of a fused QKV projection) whose
    last dimension is contiguous; ``cos`` and ``signed_sin`` are ``[num_tokens, 1, head_dim]`` in
    ``x``'s dtype. Returns ``x``.
    """
    ext = _native(x, cos, signed_sin)
    if (
        ext is None
        or x.dim() != 3
        or x.stride(-1) != 1
        or cos.dtype != x.dtype
        or signed_sin.dtype != x.dtype
    ):
        return x.copy_(reference.apply_rotary(x, cos, signed_sin))
    ext.rotary_(x, cos, signed_sin, _variant())
    return x


def write_kv_(
    kv_pool: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """``attention.paging.write_kv`` in one native call where it applies (a contiguous CPU
    pool, ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` of the pool's dtype with a
    contiguous last dimension): the decode path's per-layer write without index tensors."""
    ext = _extension()
    if (
        ext is None
        or not kv_pool.is_cpu
        or key.dtype != kv_pool.dtype
        or value.dtype != kv_pool.dtype
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or not kv_pool.is_contiguous()
    ):
        paging.write_kv(kv_pool, slot_mapping, key, value)
        return
    ext.write_kv_(kv_pool, slot_mapping, key, value)
