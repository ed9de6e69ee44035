"""Which variant of each native attention kernel this CPU runs, and why.

A kernel *family* is a set of operators chosen together: ``decode`` (paged decode attention of
every pool format and the window scores, ``ops.pick_isa``), ``prefill`` (causal prefill
attention, ``prefill_ops.prefill_isa``), ``window_fused`` (fused window scores and compaction
straight from the pages, ``window_fused.supports_window_fused``) and ``chunk_paged`` (short
chunks of queries over the pages, ``chunk_paged.chunk_isa``). Each family lists every
variant it has, fastest first; :func:`family_status` says which of them this CPU runs (the
CPUID features and, for AMX, the kernel's grant) and which one runs by default. Used by
``sparsekv bench kernels --list`` and by the test suite's summary of tested variants.
"""

from __future__ import annotations

import dataclasses

from sparsekv.attention.cpu import build, chunk_paged, ops, prefill_ops, window_fused
from sparsekv.env_flags import kernel_isa_setting

FAMILIES: dict[str, tuple[str, ...]] = {
    "decode": ("avx512_amx", "avx512", "avx2", "avx2_w16", "generic"),
    "prefill": prefill_ops.PREFILL_VARIANTS,
    "window_fused": window_fused.VARIANTS,
    "chunk_paged": chunk_paged.VARIANTS,
}


@dataclasses.dataclass(frozen=True)
class FamilyStatus:
    """The variants of one kernel family on this CPU.

    Attributes:
        family: family name (a key of :data:`FAMILIES`).
        runnable: variants this CPU runs, fastest first.
        unavailable: ``{variant: why this CPU does not run it}`` for the others.
        chosen: the variant used by default (head_dim 64 for ``decode``), or ``None``: the
            PyTorch fallback runs.
        reason: why ``chosen`` is the one.
    """

    family: str
    runnable: tuple[str, ...]
    unavailable: dict[str, str]
    chosen: str | None
    reason: str


def cpu_features() -> tuple[str, ...]:
    """x86 features the kernel variants depend on that CPUID shows (empty without the
    extension): avx2, fma, avx512f/bw/dq/vl, avx512_bf16, avx512_vnni, amx_tile/bf16/int8."""
    ext = build.load_extension()
    names = str(ext.cpu_features()) if ext is not None else ""
    return tuple(names.split(",")) if names else ()


def _runnable(family: str) -> tuple[str, ...]:
    if family == "decode":
        return ops.available_isas()
    if family == "prefill":
        return prefill_ops.prefill_isas()
    if family == "chunk_paged":
        return chunk_paged.chunk_isas()
    return window_fused.window_fused_isas()


def _why_not(family: str, variant: str) -> str:
    ext = build.load_extension()
    if family == "chunk_paged":
        return chunk_paged.chunk_isa_status(variant)
    if family != "decode" or variant == ops.PREFILL_ISA:  # the same CPU checks as prefill's
        return prefill_ops.prefill_isa_status(variant)
    if variant == "avx512":
        return "no AVX-512F"
    return "no AVX2 / FMA" if variant.startswith("avx2") else str(ext.amx_status())


def _default(family: str) -> tuple[str | None, str]:
    forced = kernel_isa_setting()
    how = f"{ops.ISA_ENV}={forced}" if forced else "the fastest this CPU runs"
    if family == "decode":
        chosen = ops.pick_isa(64)
    elif family == "prefill":
        chosen = prefill_ops.prefill_isa()
    elif family == "chunk_paged":
        chosen = chunk_paged.chunk_isa(64)
    else:
        chosen = window_fused.window_fused_isa()
    if chosen is None:
        if forced:
            return None, f"{ops.ISA_ENV}={forced} names none of its variants: PyTorch fallback"
        return None, "no variant this CPU runs: PyTorch fallback"
    return chosen, how


def family_status(family: str) -> FamilyStatus:
    """Variants of ``family`` this CPU runs and the default one; see :class:`FamilyStatus`.

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if build.native_disabled() or build.load_extension() is None:
        why = "SPARSEKV_DISABLE_NATIVE is set" if build.native_disabled() else "build failed"
        return FamilyStatus(family, (), dict.fromkeys(FAMILIES[family], why), None, why)
    runnable = _runnable(family)
    unavailable = {v: _why_not(family, v) for v in FAMILIES[family] if v not in runnable}
    chosen, reason = _default(family)
    return FamilyStatus(family, runnable, unavailable, chosen, reason)
