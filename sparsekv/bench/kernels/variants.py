"""``sparsekv bench kernels --list``: the CPU's kernel-relevant features and, for every native
kernel family (attention, the fused model ops, the packed-weight linears), the variant it runs
and why, and why each other variant does not run here; and whether KV page pools get huge
pages."""

from __future__ import annotations

from sparsekv.attention.cpu import variants
from sparsekv.attention.cpu.memory import huge_page_setting
from sparsekv.env_flags import KERNEL_ISA, kernel_isa_setting
from sparsekv.models.fused import build as fused_build
from sparsekv.models.fused import ops as fused_ops
from sparsekv.models.quant import build as quant_build
from sparsekv.models.quant import int8_rows
from sparsekv.models.quant import ops as quant_ops


def _fused_lines() -> list[str]:
    # The model ops (RMSNorm, SiLU, rotary, ...) and their bf16 GEMV / small-M GEMM.
    if fused_build.fused_disabled():
        return ["fused        PyTorch (the fused ops are disabled)"]
    ext = fused_build.load_extension()
    if ext is None:
        return ["fused        PyTorch (the fused ops failed to build)"]
    runs = str(ext.available_isas()).split(",")
    chosen, forced = fused_ops.fused_isa(), kernel_isa_setting()
    why = f"{KERNEL_ISA}={forced}" if forced else "the fastest this CPU runs"
    gemv_allowed, gemm_allowed = fused_ops.bf16_matmul_kernels_allowed()
    off = f"off ({KERNEL_ISA}={forced})"
    gemv = "no bf16 GEMV (needs AVX512-BF16)"
    if ext.has_gemv_bf16():
        gemv = "AVX512-BF16 GEMV" if gemv_allowed else f"bf16 GEMV {off}"
    gemm = "no small-M GEMM (needs AMX)"
    if ext.has_gemm_bf16_small():
        gemm = "AMX small-M GEMM" if gemm_allowed else f"small-M GEMM {off}"
    return [
        f"fused        {chosen} ({why}; runs {', '.join(runs)})",
        f"fused_gemm   batch 1: {gemv}; 2-64 rows: {gemm}",
    ]


def _packed_lines() -> list[str]:
    # The packed-weight linears (--weight-dtype gguf / int8 / bf16rows) and their variants.
    if quant_build.native_disabled():
        return ["packed       PyTorch dequantization (native kernels are disabled)"]
    runs = quant_ops.available_isas()
    if not runs:
        return ["packed       PyTorch dequantization (the packed-weight kernels failed to build)"]
    forced = quant_ops.kernel_isa()
    why = f"{quant_ops.ISA_ENV}={forced}" if forced else "the fastest this CPU runs"
    lines = [f"packed       {forced or runs[0]} ({why}; runs {', '.join(runs)})"]
    if "avx512_amx" not in runs:
        lines.append(
            f"{'':<12}   not avx512_amx: needs AVX512-VNNI, AMX-TILE and AMX-INT8 with the tile "
            "state granted by the OS (and a GCC 11 or newer build)"
        )
    if "avx512_bf16" not in runs:
        lines.append(f"{'':<12}   not avx512_bf16: needs AVX-512 F/BW/VL and AVX512-BF16")
    return lines + [_int8_rows_line(forced or runs[0])]


def _int8_rows_line(variant: str) -> str:
    # --weight-dtype w8a8's prefill path: oneDNN's int8 GEMM between the variant's passes.
    if variant not in int8_rows.INT8_ROWS_VARIANTS:
        names = ", ".join(int8_rows.INT8_ROWS_VARIANTS)
        return f"int8_rows    none on {variant} (w8a8 prefill runs as int8; needs {names})"
    if int8_rows.int8_gemm_saturates():
        gemm = "oneDNN's int8 GEMM saturates here: w8a8 weights get 7-bit codes"
    else:
        gemm = "oneDNN's int8 GEMM exact on full-range codes"
    return f"int8_rows    {variant} passes (w8a8 prefill); {gemm}"


def _page_line() -> str:
    # Whether the KV page pools get 2 MiB pages (AttentionBackend.allocate_pages advises them).
    mode = huge_page_setting()
    if mode in ("always", "madvise"):
        return f"kv pages     2 MiB pages (transparent huge pages: {mode})"
    if mode is None:
        return "kv pages     4 KiB pages (no transparent huge pages on this system)"
    return (
        f"kv pages     4 KiB pages (transparent huge pages: {mode}; decode's page reads miss the "
        "TLB: set madvise or always in /sys/kernel/mm/transparent_hugepage/enabled)"
    )


def variant_lines() -> list[str]:
    """The lines :func:`print_variants` prints."""
    lines = [
        "CPU features: " + (" ".join(variants.cpu_features()) or "(native kernels unavailable)")
    ]
    for family in variants.FAMILIES:
        info = variants.family_status(family)
        chosen = info.chosen or "PyTorch"
        line = f"{family:<12} {chosen} ({info.reason})"
        if info.runnable:
            line += f"; runs {', '.join(info.runnable)}"
        lines.append(line)
        for variant, why in info.unavailable.items():
            lines.append(f"{'':<12}   not {variant}: {why}")
    return lines + _fused_lines() + _packed_lines() + [_page_line()]


def print_variants() -> None:
    """Print the CPU features and the kernel variant of each family (see module docstring)."""
    for line in variant_lines():
        print(line)
