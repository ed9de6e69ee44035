"""Native paged CPU kernels: the Python face of ``csrc/`` (same contracts as ``torch_ref``).

Each function raises ``RuntimeError`` when the extension is unavailable; callers that want the
silent fallback use ``attention.backends.CpuNativeBackend``. ``isa`` picks a kernel variant
(``"avx512_amx"``: bf16 on AMX tiles, ``"avx512"``, ``"avx2"``, ``"avx2_w16"``, ``"generic"``); by
default the fastest one this CPU runs whose vector width divides ``head_dim``, or the one named
by ``SPARSEKV_KERNEL_ISA`` (to compare variants or rule one out; ignored with a warning where
this CPU does not run it).

Decode over quantized pages (int8, fp8, KIVI int4) is in ``quant_decode``; the causal prefill
kernels are in ``prefill_ops``.
"""

from __future__ import annotations

import contextvars
import functools
import math
import warnings

import torch

from sparsekv.attention.cpu import build
from sparsekv.env_flags import KERNEL_ISA, kernel_isa_setting
from sparsekv.ext_cache import ExtensionScope

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)  # codes of the int8 and fp8 formats
ISA_ENV = KERNEL_ISA


def native_scope() -> ExtensionScope:
    """Within the ``with`` block the kernels use the extension and the ``SPARSEKV_KERNEL_ISA``
    setting read on entry instead of checking the build and the environment on every call
    (twice per layer of a decode step)."""
    return ExtensionScope(_scope, lambda: (build.load_extension(), kernel_isa_setting()))


# (extension or None, forced variant setting) of the innermost native_scope; None outside.
_scope: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "sparsekv_attention_scope", default=None
)


def _loaded():
    """The extension: the enclosing :class:`native_scope`'s, else checked now."""
    scoped = _scope.get()
    return scoped[0] if scoped is not None else build.load_extension()


def resolved_setting() -> tuple[object | None, str]:
    """``(extension or None, SPARSEKV_KERNEL_ISA setting)``: the enclosing
    :class:`native_scope`'s, else read now (tests change the environment between calls)."""
    scoped = _scope.get()
    if scoped is not None:
        return scoped
    return build.load_extension(), kernel_isa_setting()


def _extension():
    ext = _loaded()
    if ext is None:
        raise RuntimeError("sparsekv native CPU kernels are not available")
    return ext


@functools.cache
def _variants(ext) -> tuple[tuple[str, int], ...]:
    # (name, fp32 lanes) of each variant the CPU runs, fastest first; fixed per process.
    return tuple((isa, ext.vector_width(isa)) for isa in ext.available_isas().split(","))


def available_isas() -> tuple[str, ...]:
    """Kernel variants this CPU runs, fastest first (empty without the extension)."""
    ext = build.load_extension()
    return tuple(name for name, _ in _variants(ext)) if ext is not None else ()


@functools.cache
def _warn_unusable_isa(name: str, head_dim: int) -> None:
    warnings.warn(
        f"{ISA_ENV}={name!r} is not a kernel variant this CPU runs for head_dim {head_dim} "
        f"(it runs {', '.join(available_isas()) or 'none'}); using the default",
        RuntimeWarning,
        stacklevel=5,
    )


def pick_isa(head_dim: int, quantized: bool = False) -> str | None:
    """Variant for ``head_dim`` (a multiple of twice the variant's fp32 lane count, as for int4
    pages too; four times for int8 / fp8 pools: ``quantized``): the one ``SPARSEKV_KERNEL_ISA``
    names if this CPU runs it, else the fastest that fits."""
    ext, forced = resolved_setting()  # the choice is cached per setting
    if ext is None:
        return None
    return _pick_isa(ext, head_dim, quantized, forced)


@functools.cache
def _pick_isa(ext, head_dim: int, quantized: bool, forced: str) -> str | None:
    # Variants whose vector width divides head_dim as the kernels need.
    lanes_per_step = 4 if quantized else 2
    fits = [isa for isa, width in _variants(ext) if head_dim % (lanes_per_step * width) == 0]
    if forced == BF16_ISA:  # a prefill variant; its CPUs decode on the AVX-512F kernels
        forced = "avx512"
    if forced:
        if forced in fits:
            return forced
        _warn_unusable_isa(forced, head_dim)
    # avx2_w16 is a test vehicle for the AVX-512 code on AVX2 CPUs, slower than avx2.
    return next((isa for isa in fits if isa != "avx2_w16"), None)


def supports(query: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """True when the native kernels take these tensors (CPU, fp32/bf16 alike, contiguous pool)."""
    return decode_isa(query, kv_pool) is not None


def decode_isa(query: torch.Tensor, kv_pool: torch.Tensor) -> str | None:
    """The variant :func:`paged_decode_attention` runs on these tensors (:func:`pick_isa`), or
    ``None`` where the native kernels do not take them (:func:`supports`)."""
    if not (
        query.is_cpu
        and kv_pool.is_cpu
        and query.dtype in NATIVE_DTYPES
        and kv_pool.dtype == query.dtype
        and kv_pool.dim() == 5
        and kv_pool.is_contiguous()
        and not query.requires_grad
    ):
        return None
    return pick_isa(kv_pool.shape[-1])


@functools.cache
def _operator(ext, name: str):
    # The operator's single overload: calling it skips the packet's overload resolution (a few
    # microseconds per call, 30 calls per decode step).
    return getattr(ext, name).default


def run_paged_decode(
    op_name: str,
    query: torch.Tensor,
    pages: tuple[torch.Tensor, ...],
    num_kv_heads: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None,
    sliding_window: int | None,
    logit_softcap: float | None,
    return_attn_mass: bool,
    isa: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run paged-decode operator ``op_name`` (``paged_decode``, ``paged_decode_quantized``,
    ``paged_decode_int4``) with the plumbing every page format shares: the empty batch, the
    default first slots, the scalar arguments in the kernel's types and the optional mass.
    ``pages`` are the format's page tensors as its operator takes them; the other arguments and
    the result as :func:`paged_decode_attention`."""
    op = _operator(_extension(), op_name)
    if query.shape[0] == 0:  # a batch of no requests: the shapes the kernels would return
        lse = query.new_empty((0, query.shape[1]), dtype=torch.float32)
        mass = query.new_empty((0, num_kv_heads, 0), dtype=torch.float32)
        return query.clone(), lse, mass if return_attn_mass else None
    if first_slots is None:
        first_slots = torch.zeros_like(seq_lens)
    out, lse, mass = op(
        query,
        *pages,
        block_tables,
        seq_lens,
        first_slots,
        float(scale),
        int(sliding_window or 0),
        float(logit_softcap or 0.0),
        bool(return_attn_mass),
        isa,
    )
    return out, lse, (mass if return_attn_mass else None)


def paged_decode_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    return_attn_mass: bool = False,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode attention reading K/V pages in place; see ``torch_ref.paged_decode_attention``.

    Args:
        query: ``[batch, num_heads, head_dim]`` fp32 or bf16 (the pool's dtype).
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``, contiguous.
        block_tables: ``[batch, max_blocks]`` int64 page ids.
        seq_lens: ``[batch]`` int64 logical slot counts (new token included).
        scale: softmax scale.
        first_slots: ``[batch]`` int64 logical slot of each first held page (default 0).
        sliding_window: optional window in slots.
        logit_softcap: optional tanh soft-cap of the logits.
        return_attn_mass: also return each held slot's probability summed over its group.
        isa: kernel variant (default: :func:`pick_isa`).

    Returns:
        out ``[batch, num_heads, head_dim]`` (query dtype), lse ``[batch, num_heads]`` fp32,
        mass ``[batch, num_kv_heads, max_blocks * block_size]`` fp32 or ``None``. A request
        that sees no slot gets a zero output and ``lse = -inf`` (the reference gives NaN).

    Raises:
        RuntimeError: the extension is unavailable or rejects the arguments.
    """
    return run_paged_decode(
        "paged_decode",
        query,
        (kv_pool,),
        kv_pool.shape[2],
        block_tables,
        seq_lens,
        scale,
        first_slots,
        sliding_window,
        logit_softcap,
        return_attn_mass,
        isa or pick_isa(query.shape[-1]) or "generic",
    )


def window_scores_paged(
    window_queries: torch.Tensor,
    lse: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_slots: int,
    scale: float,
    isa: str | None = None,
) -> torch.Tensor:
    """Window scores over paged keys; see ``attention.reference.window_scores_paged``.

    Args:
        window_queries: ``[num_heads, window, head_dim]`` fp32 or bf16.
        lse: ``[num_heads, window]`` fp32.
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``, contiguous.
        block_table: ``[num_blocks]`` int64 page ids, slot 0 first.
        num_slots: held slots.
        scale: softmax scale.
        isa: kernel variant (default: :func:`pick_isa`).

    Returns:
        ``[num_heads, num_slots]`` fp32.

    Raises:
        RuntimeError: the extension is unavailable or rejects the arguments.
    """
    ext = _extension()
    return ext.window_scores(
        window_queries,
        lse,
        kv_pool,
        block_table,
        int(num_slots),
        float(scale),
        isa or pick_isa(kv_pool.shape[-1]) or "generic",
    )


def check_softmax_scale(scale: float) -> None:
    """Raise ``ValueError`` unless ``scale`` is a positive finite number: the prefill and
    window-score kernels take a row's largest logit as its top, which a zero, negative or
    non-finite scale would turn into NaN or its smallest."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")


PREFILL_ISA = "avx512_amx"  # the AMX-tile kernels (prefill, fused window scores)
BF16_ISA = "avx512_bf16"  # the AVX512-BF16 prefill kernel (CPUs without AMX)


def amx_tiles_enabled() -> bool:
    """True when the AMX-tile kernels (prefill attention, fused window scores: one compilation
    unit under one AMX grant) can run: the extension is built, the CPU and kernel grant AMX,
    and ``SPARSEKV_KERNEL_ISA`` does not force another variant (read per call: tests set it)."""
    forced = kernel_isa_setting()
    if forced and forced != PREFILL_ISA:
        return False
    ext = build.load_extension()
    return ext is not None and _prefill_available(ext)


@functools.cache
def _prefill_available(ext) -> bool:
    # The AMX kernel is compiled and the CPU / kernel grant AMX; fixed per process.
    return bool(ext.prefill_available())
