"""Micro-benchmark of the fused ops against the eager code they replace.

``python -m sparsekv.models.fused.bench [--threads N] [--rows 4000 8] [--dtype bfloat16]``
prints, per op and row count, the median milliseconds of the eager code (``reference``) and of
the native kernel, at SmolLM2-135M's sizes (hidden 576, intermediate 1536, 9 + 3 heads of 64)
and Gemma 3 270M's GeGLU (intermediate 2048).

``python -m sparsekv.models.fused.bench --gemm [--threads N]`` instead times SmolLM2-135M's
linear layers at decode row counts: oneDNN's packed linear (what ``PackedLinear`` runs above
``SMALL_GEMM_MAX_ROWS`` rows) against the native small-M GEMM and, at one row, the GEMV; best of
repeated calls in microseconds (the weights stay in cache between calls: a model's decode step
reads them from memory). ``--gemm-stream`` times what a decode step reads instead: the linear
layers of all 30 layers plus the lm_head, each weight its own tensor (269 MB, read from memory),
oneDNN and the native kernels alternating; best of 6 passes in milliseconds.
"""

from __future__ import annotations

import os
import time

import torch

from sparsekv.cli_help import doc_parser
from sparsekv.models.fused import build, reference
from sparsekv.models.prepack import GEMV_MAX_WEIGHT_BYTES

HIDDEN, INTERMEDIATE, GEMMA_INTERMEDIATE = 576, 1536, 2048
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def median_ms(fn, min_seconds: float = 0.3, max_reps: int = 2000) -> float:
    """Median wall time of ``fn()`` in milliseconds (after one warm-up call)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 5 or time.perf_counter() - start < min_seconds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def cases(rows: int, dtype: torch.dtype, ext) -> dict[str, tuple]:
    """Op name -> (eager callable, native callable) on fresh random inputs."""
    x, delta = torch.randn(2, rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE).to(dtype)
    gemma_gate_up = torch.randn(rows, 2 * GEMMA_INTERMEDIATE).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    # A true rotation: the native op runs in place, and repeated calls must keep |x| (random
    # tables would shrink it into subnormals, which are slow).
    angles = torch.rand(rows, 1, HEAD_DIM // 2) * 6.28
    cos = angles.cos().repeat(1, 1, 2).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).to(dtype)
    return {
        f"rms_norm [{rows}, {HIDDEN}]": (
            lambda: reference.rms_norm(x, weight, 1e-5),
            lambda: ext.rms_norm(x, weight, 1e-5, False),
        ),
        f"add + rms_norm [{rows}, {HIDDEN}]": (
            lambda: reference.add_rms_norm(x, delta, weight, 1e-5),
            lambda: ext.add_rms_norm(x, delta, weight, 1e-5, False),
        ),
        f"silu_mul [{rows}, 2x{INTERMEDIATE}]": (
            lambda: reference.silu_mul(gate_up),
            lambda: ext.silu_mul(gate_up),
        ),
        f"gelu_tanh_mul [{rows}, 2x{GEMMA_INTERMEDIATE}]": (
            lambda: reference.gelu_tanh_mul(gemma_gate_up),
            lambda: ext.gelu_tanh_mul(gemma_gate_up),
        ),
        f"rotary [{rows}, {HEADS + KV_HEADS}, {HEAD_DIM}]": (
            lambda: reference.apply_rotary(qk, cos, sin),
            lambda: ext.rotary_(qk, cos, sin),
        ),
    }


# SmolLM2-135M's linear layers (out, in): fused QKV, o_proj, gate_up, down, lm_head; and one
# K / V projection of an unfused model.
GEMM_SHAPES = ((960, 576), (576, 576), (192, 576), (3072, 576), (576, 1536), (49152, 576))
GEMM_ROWS = (1, 2, 4, 8, 16, 32, 48)


def best_us(fn, *args, reps: int = 50) -> float:
    """Fastest of ``reps`` calls of ``fn(*args)`` in microseconds (after two warm-up calls)."""
    fn(*args)
    fn(*args)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def gemm_table(ext) -> None:
    """Print a Markdown table: shape, rows, oneDNN us, small-M GEMM us, GEMV us, speed-up."""
    onednn = torch.ops.mkldnn._linear_pointwise.default
    print("| out x in | rows | oneDNN us | small-M GEMM us | GEMV us | best native speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, k in GEMM_SHAPES:
        weight = torch.randn(n, k).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        for rows in GEMM_ROWS:
            x = torch.randn(rows, k).to(torch.bfloat16)
            base = best_us(onednn, x, packed, None, "none", [], "")
            gemm = best_us(ext.gemm_bf16_small, x, weight)
            gemv = best_us(ext.gemv_bf16, x, weight) if rows == 1 else float("nan")
            best = min(gemm, gemv) if rows == 1 else gemm
            print(
                f"| {n}x{k} | {rows} | {base:.0f} | {gemm:.0f} | {gemv:.0f} | {base / best:.2f}x |"
            )


def gemm_stream_table(ext, layers: int = 30) -> None:
    """Print a Markdown table: rows, ms per pass over every linear layer of SmolLM2-135M
    (``layers`` x QKV, o_proj, gate_up, down, and the lm_head) through oneDNN and natively."""
    onednn = torch.ops.mkldnn._linear_pointwise.default
    shapes = [shape for shape in GEMM_SHAPES if shape != (192, 576)]
    weights = [torch.randn(shape).to(torch.bfloat16) for shape in shapes[:-1] * layers]
    weights.append(torch.randn(shapes[-1]).to(torch.bfloat16))
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]

    def run_onednn(xs):
        for w, p in zip(weights, packed):
            onednn(xs[w.shape[1]], p, None, "none", [], "")

    def run_native(xs):  # as PackedLinear: the GEMV for one row of a small weight
        one_row = len(xs[HIDDEN]) == 1
        for w in weights:
            gemv = one_row and w.numel() * w.element_size() <= GEMV_MAX_WEIGHT_BYTES
            (ext.gemv_bf16 if gemv else ext.gemm_bf16_small)(xs[w.shape[1]], w)

    print("| rows | oneDNN ms | native ms | speed-up |\n|---:|---:|---:|---:|")
    for rows in (1, 2, 4, 8, 16, 32):
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
        best = [float("inf"), float("inf")]
        for _ in range(6):
            for i, run in enumerate((run_onednn, run_native)):
                t0 = time.perf_counter()
                run(xs)
                best[i] = min(best[i], time.perf_counter() - t0)
        print(f"| {rows} | {best[0] * 1e3:.1f} | {best[1] * 1e3:.1f} | {best[0] / best[1]:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    """Print a Markdown table: op, eager ms, fused ms, speed-up (or ``gemm_table``)."""
    parser = doc_parser(None, __doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--rows", type=int, nargs="+", default=[4000, 8], help="token rows")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--gemm", action="store_true", help="time the linear layers instead")
    parser.add_argument(
        "--gemm-stream", action="store_true", help="time a decode step's linears from memory"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = build.load_extension()
    if ext is None:
        raise SystemExit("fused ops unavailable (disabled or the build failed)")
    dtype = getattr(torch, args.dtype)
    load = os.getloadavg()[0]
    if args.gemm or args.gemm_stream:
        if not ext.has_gemm_bf16_small() or not ext.has_gemv_bf16():
            raise SystemExit("the native bf16 GEMM / GEMV need AMX-BF16 and AVX512-BF16")
        print(f"bf16, {torch.get_num_threads()} threads, load average {load:.2f}\n")
        with torch.inference_mode():
            gemm_stream_table(ext) if args.gemm_stream else gemm_table(ext)
        return
    print(f"{args.dtype}, {torch.get_num_threads()} threads, load average {load:.2f}\n")
    print("| op | eager ms | fused ms | speed-up |\n|---|---:|---:|---:|")
    with torch.inference_mode():
        for rows in args.rows:
            for name, (eager, native) in cases(rows, dtype, ext).items():
                e, f = median_ms(eager), median_ms(native)
                print(f"| {name} | {e:.3f} | {f:.3f} | {e / f:.1f}x |")


if __name__ == "__main__":
    main()
