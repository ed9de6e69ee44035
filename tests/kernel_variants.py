"""Kernel variants in the test suite: which cases run on this CPU, and the run's summary line.

A test marked ``@pytest.mark.kernel_variant(family, variant)`` checks one variant of a native
kernel family (``sparsekv.attention.cpu.variants.FAMILIES``, plus ``fused`` and
``fused_small_gemm`` for the model ops and ``packed_weights`` for the packed linears);
``kernel_variant(family)`` checks every variant the CPU
runs (the test loops over them). At collection, the cases of a variant this CPU cannot run are
deselected and named, with the reason, as untested in the summary printed after the run; they
are never skipped silently. The summary counts the cases that ran (passed or failed), not
those collected: a case deselected by ``-k`` / ``-m`` or skipped at run time is not counted. When the extension fails to build the cases stay selected and fail
(CI must not pass on a build failure); ``SPARSEKV_DISABLE_NATIVE=1`` deselects them on purpose.
"""

from __future__ import annotations

import functools

import pytest

MARKER = "kernel_variant"
FUSED_FAMILIES = {"fused": ("avx512", "avx2", "generic"), "fused_small_gemm": ("avx512_amx",)}
# Packed-weight linears (sparsekv.models.quant); avx512_bf16 needs AVX-512 F/BW/VL + AVX512-BF16.
PACKED_FAMILY, PACKED_VARIANTS = (
    "packed_weights",
    ("avx512_amx", "avx512_vnni", "avx512_bf16", "avx2", "generic"),
)

_tested: dict[str, dict[str, int]] = {}
_untested: dict[str, dict[str, str]] = {}
_variants_of: dict[str, list[tuple[str, str]]] = {}  # node id -> (family, variant) it checks


@functools.cache
def status(family: str) -> tuple[tuple[str, ...], dict[str, str], bool]:
    """(runnable variants, {variant: why not} for the others, build failed) of ``family``."""
    if family == PACKED_FAMILY:
        from sparsekv.attention.cpu.build import native_disabled
        from sparsekv.models.quant import build as quant_build

        ext = quant_build.load_extension()
        if ext is None:
            why = "native kernels disabled"
            return (), dict.fromkeys(PACKED_VARIANTS, why), not native_disabled()
        runs = tuple(str(ext.available_isas()).split(","))
        return (
            runs,
            {v: "this CPU does not run it" for v in PACKED_VARIANTS if v not in runs},
            False,
        )
    if family in FUSED_FAMILIES:
        from sparsekv.models.fused import build as fused_build

        ext = fused_build.load_extension()
        if ext is None:
            failed = not fused_build.fused_disabled()
            return (), dict.fromkeys(FUSED_FAMILIES[family], "fused ops disabled"), failed
        if family == "fused":
            runs = tuple(str(ext.available_isas()).split(","))
        else:
            runs = ("avx512_amx",) if ext.has_gemm_bf16_small() else ()
        why = "this CPU does not run it" if family == "fused" else "no AMX-BF16 small-M GEMM"
        return runs, {v: why for v in FUSED_FAMILIES[family] if v not in runs}, False
    from sparsekv.attention.cpu import build, variants

    failed = not build.native_disabled() and build.load_extension() is None
    info = variants.family_status(family)
    return info.runnable, info.unavailable, failed


def native(family: str) -> str:
    """The variant ``family`` runs by default here (its fastest; the first listed if the
    extension is unavailable, so that its cases run and fail)."""
    from sparsekv.attention.cpu import variants

    runs = status(family)[0]
    return runs[0] if runs else variants.FAMILIES[family][0]


def lower(family: str) -> tuple[str, ...]:
    """The variants of ``family`` other than :func:`native` (forced in tests)."""
    from sparsekv.attention.cpu import variants

    return tuple(v for v in variants.FAMILIES[family] if v != native(family))


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the cases of variants this CPU cannot run and record what runs."""
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker(MARKER)
        if marker is None:
            keep.append(item)
            continue
        family, variant = marker.args[0], marker.args[1] if len(marker.args) > 1 else None
        runs, unavailable, failed = status(family)
        untested = _untested.setdefault(family, {})
        if failed:
            keep.append(item)  # the build failed: the case runs and fails
            continue
        if variant is None:
            _variants_of[item.nodeid] = [(family, v) for v in runs]
            untested.update(unavailable)
            (keep if runs else drop).append(item)
        elif variant in runs:
            _variants_of[item.nodeid] = [(family, variant)]
            keep.append(item)
        else:
            untested[variant] = unavailable.get(variant, "unknown variant")
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def record(report: pytest.TestReport) -> None:
    """Count a case's variants once its test body ran (passed or failed, not skipped)."""
    if report.when != "call" or report.skipped:
        return
    for family, variant in _variants_of.get(report.nodeid, ()):
        tested = _tested.setdefault(family, {})
        tested[variant] = tested.get(variant, 0) + 1


def summary() -> str | None:
    """One line: the variants whose cases ran (with how many), and those left untested with
    the reason."""
    if not _tested and not _untested:
        return None
    ran = [f"{f}/{v} ({n})" for f, vs in _tested.items() for v, n in vs.items()]
    left = [
        f"{f}/{v} ({why})"
        for f, vs in _untested.items()
        for v, why in vs.items()
        if v not in _tested.get(f, {})
    ]
    return (
        "kernel variants tested (cases run): "
        + (", ".join(ran) or "none")
        + "; untested, this CPU cannot run them: "
        + (", ".join(left) or "none")
    )
