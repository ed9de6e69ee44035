"""``sparsekv bench kernels``: attention kernels against their memory or FLOP bound.

Measures the machine once (read bandwidth from a large fp32 sum, matmul FLOP/s per dtype), then
times, for the given shapes (default: SmolLM2 S1, 16 requests x 2000 tokens, 30 layers):

- paged decode attention, native vs the PyTorch reference, against the bandwidth bound of one
  step (bytes of K/V read / read bandwidth);
- the window-score pass over paged keys against the fp32 FLOP bound;
- prefill attention with LSE (``attention_with_lse`` vs ``backend.prefill_attention``) against
  the FLOP bound of causal attention;
- with ``--kv-dtypes`` (e.g. ``bf16,int8,fp8,int4``), native paged decode over pages of each KV
  dtype at the same shape (int8 / fp8: ``kv_cache.quant`` codes and per-slot fp32 scales, read
  in place by ``ops.paged_decode_attention_quantized``; int4: KIVI codes with fp16 per-channel
  key and per-slot value scales and zeros, ``ops.paged_decode_attention_int4``): ms per step,
  bytes read per call (codes + scales) and the GB/s that makes. ``--dtypes ''`` skips the rows
  above.

Prints ms, bound and ratio per row and writes a JSON report (``--output``) with provenance and
the same rows as a Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sparsekv.attention import backend, torch_ref
from sparsekv.attention.cpu import build, ops
from sparsekv.attention.cpu.memory import advise_huge_pages
from sparsekv.attention.cpu.reference import window_scores_paged as ref_window_scores
from sparsekv.evaluation.report import markdown_table
from sparsekv.kv_cache import quant

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
QUANTIZERS = {"int8": quant.quantize_int8, "fp8": quant.quantize_fp8}
KV_DTYPES = (*DTYPES, *QUANTIZERS, "int4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsekv bench kernels", description=__doc__)
    parser.add_argument("--batch", type=int, default=16, help="requests per decode step")
    parser.add_argument("--tokens", type=int, default=2000, help="cached tokens per request")
    parser.add_argument("--layers", type=int, default=30, help="layers per step")
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--dtypes", default="bf16,fp32", help="comma list of bf16, fp32 ('' for none)"
    )
    parser.add_argument(
        "--kv-dtypes",
        default="",
        help="comma list of fp32, bf16, int8, fp8, int4: native decode over pages of each at the "
        "decode shape, with bytes per call and GB/s ('' skips)",
    )
    parser.add_argument(
        "--kv-query-dtype",
        default="bf16",
        choices=tuple(DTYPES),
        help="query dtype of the int8 / fp8 / int4 rows (fp32 / bf16 pages take their own)",
    )
    parser.add_argument("--window", type=int, default=32, help="observation window rows")
    parser.add_argument("--prefill-tokens", type=int, default=4000, help="0 skips prefill")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (best is kept)")
    parser.add_argument("--no-reference", action="store_true", help="skip the torch_ref rows")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--isa",
        default=None,
        help="native kernel variant (default: the fastest this CPU runs; see ops.available_isas)",
    )
    parser.add_argument("--output", default="reports/kernels.json")
    return parser


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``fn`` in seconds over ``repeats`` runs, after one warm-up."""
    return timed(fn, repeats)[0]


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best wall seconds, process CPU seconds per intra-op thread of that run) of ``fn``.

    On a machine shared with other work the CPU time per thread estimates the uncontended wall
    time (an upper bound: stalls on memory that others contend for count too).
    """
    fn()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - start
        if wall < best:
            best, best_cpu = wall, (time.process_time() - cpu) / torch.get_num_threads()
    return best, best_cpu


def measure_machine(repeats: int) -> dict:
    """Read bandwidth (bytes/s, fp32 sum of 512 MiB) and matmul FLOP/s per dtype."""
    data = torch.ones(128 * 1024 * 1024)
    read_bw = data.numel() * 4 / best_time(data.sum, repeats)
    del data
    flops = {}
    for name, dtype in DTYPES.items():
        n = 1024
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        flops[name] = 2 * n**3 / best_time(lambda a=a, b=b: a @ b, repeats)
    return {"read_bandwidth": read_bw, "matmul_flops": flops}


def num_step_pages(args: argparse.Namespace) -> int:
    """Pages one decode step reads: every request's blocks in every layer."""
    return args.batch * -(-args.tokens // args.block_size) * args.layers


def make_pages(args: argparse.Namespace, kv_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pages of one decode step: ``[num_pages, 2, kvh, block_size, head_dim]`` of ``kv_name``
    (``KV_DTYPES``) and, for int8 / fp8, their ``[num_pages, 2, kvh, block_size]`` fp32 scales
    (Gaussian K/V quantized by ``kv_cache.quant``, so codes are distributed as in use)."""
    num_pages = num_step_pages(args)
    shape = (num_pages, 2, args.num_kv_heads, args.block_size, args.head_dim)
    if kv_name in DTYPES:
        pool = torch.empty(shape, dtype=DTYPES[kv_name])
        advise_huge_pages(pool)  # as the engine's pool should be (see attention/cpu/memory.py)
        return pool.normal_(), None
    data = torch.empty(shape, dtype=torch.int8 if kv_name == "int8" else quant.FP8_DTYPE)
    scales = torch.empty(shape[:4])
    advise_huge_pages(data)
    advise_huge_pages(scales)
    chunk = max(1, (64 << 20) // (shape[1] * shape[2] * shape[3] * shape[4] * 4))  # 64 MiB fp32
    for start in range(0, num_pages, chunk):
        pages = slice(start, min(start + chunk, num_pages))
        data[pages], scales[pages] = QUANTIZERS[kv_name](torch.randn(data[pages].shape))
    return data, scales


def make_int4_pages(args: argparse.Namespace) -> list[torch.Tensor]:
    """KIVI int4 pages of one decode step, as ``Int4Storage`` lays them out: codes
    ``[num_pages, 2, kvh, block_size, head_dim // 2]`` uint8, key scale and zero
    ``[num_pages, kvh, head_dim]`` and value scale and zero ``[num_pages, kvh, block_size]``
    fp16 (Gaussian K/V quantized a page at a time by ``kv_cache.quant``)."""
    num_pages, kvh, bs, d = num_step_pages(args), args.num_kv_heads, args.block_size, args.head_dim
    tensors = [
        torch.empty((num_pages, 2, kvh, bs, d // 2), dtype=torch.uint8),
        torch.empty((num_pages, kvh, d), dtype=torch.float16),
        torch.empty((num_pages, kvh, d), dtype=torch.float16),
        torch.empty((num_pages, kvh, bs), dtype=torch.float16),
        torch.empty((num_pages, kvh, bs), dtype=torch.float16),
    ]
    for tensor in tensors:
        advise_huge_pages(tensor)
    chunk = max(1, (64 << 20) // (2 * kvh * bs * d * 4))  # 64 MiB of fp32 K/V at a time
    for start in range(0, num_pages, chunk):
        pages = slice(start, min(start + chunk, num_pages))
        kv = torch.randn(tensors[0][pages].shape[:-1] + (d,))
        key_codes, *key_params = quant.quantize_int4_keys(kv[:, 0])
        value_codes, *value_params = quant.quantize_int4_values(kv[:, 1])
        tensors[0][pages] = torch.stack((key_codes, value_codes), dim=1)
        for tensor, part in zip(tensors[1:], key_params + value_params):
            tensor[pages] = part
    return tensors


def int4_bytes_per_call(args: argparse.Namespace) -> int:
    """Bytes one layer's int4 decode reads: the codes of every held slot's key and value rows,
    each held page's key scales and zeros, each held slot's value scale and zero."""
    slots = args.batch * args.tokens * args.num_kv_heads
    pages = args.batch * -(-args.tokens // args.block_size) * args.num_kv_heads
    return slots * 2 * (args.head_dim // 2) + pages * 2 * args.head_dim * 2 + slots * 2 * 2


def decode_inputs(args: argparse.Namespace, dtype: torch.dtype) -> tuple[list, torch.Tensor]:
    """Per-layer (query ``[batch, num_heads, head_dim]``, block table ``[batch, num_blocks]`` of
    shuffled page ids) of one decode step, and seq_lens ``[batch]``."""
    num_blocks = -(-args.tokens // args.block_size)
    perm = torch.randperm(num_step_pages(args))
    per_layer = args.batch * num_blocks
    layers = []
    for layer in range(args.layers):
        table = perm[layer * per_layer : (layer + 1) * per_layer].view(args.batch, num_blocks)
        query = torch.randn(args.batch, args.num_heads, args.head_dim).to(dtype)
        layers.append((query, table.contiguous()))
    return layers, torch.full((args.batch,), args.tokens, dtype=torch.long)


def decode_case(args: argparse.Namespace, dtype_name: str) -> tuple[list, Callable]:
    """Inputs of one decode step over all layers: per-layer (query, block table), the pool."""
    pool, _ = make_pages(args, dtype_name)
    layers, seq_lens = decode_inputs(args, DTYPES[dtype_name])
    scale = args.head_dim**-0.5

    def step(attention: Callable) -> Callable[[], None]:
        def run() -> None:
            for query, table in layers:
                attention(query, pool, table, seq_lens, scale)

        return run

    return layers, step


def native_isa(args: argparse.Namespace, quantized: bool = False) -> str | None:
    """The kernel variant to time: ``--isa`` (checked against this CPU) or the default pick
    (for int8 / fp8 pages: ``quantized``)."""
    if args.isa is not None and args.isa not in ops.available_isas():
        raise ValueError(
            f"--isa {args.isa!r} is not a kernel variant this CPU runs: {ops.available_isas()}"
        )
    return args.isa or ops.pick_isa(args.head_dim, quantized)


def row(name: str, times: tuple[float, float], bound: float, note: str) -> dict:
    seconds, cpu = times
    print(
        f"{name:<46} {seconds * 1e3:9.1f} ms (cpu/thread {cpu * 1e3:8.1f})  "
        f"bound {bound * 1e3:8.1f} ms ({note})  x{seconds / bound:5.2f}"
    )
    return {
        "name": name,
        "ms": seconds * 1e3,
        "cpu_ms_per_thread": cpu * 1e3,
        "bound_ms": bound * 1e3,
        "ratio": seconds / bound,
    }


def bench_decode(args, dtype_name: str, machine: dict) -> list[dict]:
    dtype = DTYPES[dtype_name]
    layers, step = decode_case(args, dtype_name)
    kv_bytes = 2 * args.batch * args.tokens * args.num_kv_heads * args.head_dim * args.layers
    kv_bytes *= torch.finfo(dtype).bits // 8
    bound = kv_bytes / machine["read_bandwidth"]
    note = f"{kv_bytes / 1e6:.0f} MB of K/V"
    rows = []
    label = f"{args.batch}x{args.tokens} x{args.layers} layers {dtype_name}"
    if build.load_extension() is not None:
        native = functools.partial(ops.paged_decode_attention, isa=native_isa(args))
        rows.append(
            row(
                f"decode native {label}",
                timed(step(native), args.repeats),
                bound,
                note,
            )
        )
    if not args.no_reference:
        rows.append(
            row(
                f"decode torch_ref {label}",
                timed(step(torch_ref.paged_decode_attention), max(1, args.repeats // 2)),
                bound,
                note,
            )
        )
    return rows


def paged_attention(args: argparse.Namespace, kv_name: str) -> tuple[Callable, int]:
    """Native decode over fp32 / bf16 / int8 / fp8 pages of one step (bound to them) and the
    bytes one layer's call reads (elements or codes, and per-slot scales)."""
    data, scales = make_pages(args, kv_name)
    isa = native_isa(args, quantized=scales is not None)
    slots = args.batch * args.tokens * args.num_kv_heads * 2  # K and V rows per layer
    bytes_per_call = slots * args.head_dim * data.element_size()
    if scales is None:
        return functools.partial(ops.paged_decode_attention, kv_pool=data, isa=isa), bytes_per_call
    attend = functools.partial(
        ops.paged_decode_attention_quantized, kv_data=data, kv_scales=scales, isa=isa
    )
    return attend, bytes_per_call + slots * scales.element_size()


def int4_attention(args: argparse.Namespace) -> tuple[Callable, int]:
    """Native decode over the int4 pages of one step (bound to them) and the bytes one layer's
    call reads (:func:`int4_bytes_per_call`)."""
    names = ("codes", "key_scale", "key_zero", "value_scale", "value_zero")
    tensors = dict(zip(names, make_int4_pages(args)))
    attend = functools.partial(ops.paged_decode_attention_int4, **tensors, isa=native_isa(args))
    return attend, int4_bytes_per_call(args)


def bench_decode_kv(args: argparse.Namespace, kv_name: str, machine: dict) -> dict:
    """Native decode over ``kv_name`` pages (``KV_DTYPES``) at the decode shape: one row with the
    bytes each call (one layer) reads, codes and scales, and the rate that makes."""
    if kv_name == "int4":
        attend, bytes_per_call = int4_attention(args)
    else:
        attend, bytes_per_call = paged_attention(args, kv_name)
    query_name = kv_name if kv_name in DTYPES else args.kv_query_dtype
    layers, seq_lens = decode_inputs(args, DTYPES[query_name])
    scale = args.head_dim**-0.5

    def step() -> None:
        for query, table in layers:
            attend(query, block_tables=table, seq_lens=seq_lens, scale=scale)

    step_bytes = bytes_per_call * args.layers
    bound = step_bytes / machine["read_bandwidth"]
    label = f"decode native {args.batch}x{args.tokens} x{args.layers} layers"
    result = row(
        f"{label} kv {kv_name} q {query_name}",
        timed(step, args.repeats),
        bound,
        f"{step_bytes / 1e6:.0f} MB of codes + scales",
    )
    result.update(
        kv_dtype=kv_name,
        query_dtype=query_name,
        bytes_per_call=bytes_per_call,
        gb_per_s=step_bytes / (result["ms"] * 1e-3) / 1e9,
    )
    print(f"{'':<46} {bytes_per_call / 1e6:9.2f} MB per call, {result['gb_per_s']:.1f} GB/s")
    return result


def bench_window(args, dtype_name: str, machine: dict) -> list[dict]:
    dtype = DTYPES[dtype_name]
    num_slots = args.tokens
    num_blocks = -(-num_slots // args.block_size)
    pool = torch.randn(num_blocks, 2, args.num_kv_heads, args.block_size, args.head_dim).to(dtype)
    table = torch.randperm(num_blocks)
    queries = torch.randn(args.num_heads, args.window, args.head_dim).to(dtype)
    lse = torch.full((args.num_heads, args.window), 8.0)
    scale = args.head_dim**-0.5
    flops = 2 * args.num_heads * args.window * num_slots * args.head_dim * args.layers
    bound = flops / machine["matmul_flops"]["fp32"]
    note = f"{flops / 1e9:.2f} GFLOP at fp32 matmul rate"
    label = f"{args.num_heads}h x{args.window} rows x{num_slots} slots x{args.layers} {dtype_name}"

    def run(fn: Callable) -> Callable[[], None]:
        return lambda: [fn(queries, lse, pool, table, num_slots, scale) for _ in range(args.layers)]

    rows = []
    if build.load_extension() is not None:
        native = functools.partial(ops.window_scores_paged, isa=native_isa(args))
        rows.append(
            row(
                f"window native {label}",
                timed(run(native), args.repeats),
                bound,
                note,
            )
        )
    if not args.no_reference:
        rows.append(
            row(
                f"window reference {label}",
                timed(run(ref_window_scores), args.repeats),
                bound,
                note,
            )
        )
    return rows


def bench_prefill(args, dtype_name: str, machine: dict) -> list[dict]:
    dtype = DTYPES[dtype_name]
    n, d = args.prefill_tokens, args.head_dim
    query = torch.randn(args.num_heads, n, d).to(dtype)
    key = torch.randn(args.num_kv_heads, n, d).to(dtype)
    value = torch.randn(args.num_kv_heads, n, d).to(dtype)
    flops = 4 * args.num_heads * n * n * d / 2  # QK^T and PV, causal half
    # Without native bf16 units the flash kernel computes bf16 in fp32: take the faster rate.
    rate = max(machine["matmul_flops"][dtype_name], machine["matmul_flops"]["fp32"])
    bound = flops / rate
    note = f"{flops / 1e9:.1f} GFLOP at {rate / 1e9:.0f} GFLOP/s"
    scale = d**-0.5
    repeats = max(1, args.repeats // 2)
    return [
        row(
            f"prefill attention_with_lse (mask) {n} {dtype_name}",
            timed(lambda: torch_ref.attention_with_lse(query, key, value, scale), repeats),
            bound,
            note,
        ),
        row(
            f"prefill backend (is_causal) {n} {dtype_name}",
            timed(lambda: backend.prefill_attention(query, key, value, scale), repeats),
            bound,
            note,
        ),
    ]


def provenance(args: argparse.Namespace) -> dict:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        sha = ""
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                flags = [f for f in line.split(":", 1)[1].split() if f in wanted]
                break
    except OSError:
        pass
    return {
        "git_sha": sha,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": flags,
        "kernel_variants": list(ops.available_isas()),
        "kernel_variant_used": native_isa(args) if build.load_extension() else None,
    }


def run(args: argparse.Namespace) -> dict:
    """Run every benchmark of ``args``, write the JSON and Markdown reports; returns the JSON."""
    kv_names = list(filter(None, args.kv_dtypes.split(",")))
    unknown = sorted(set(kv_names) - set(KV_DTYPES))
    if unknown:
        raise ValueError(f"--kv-dtypes: unknown {unknown}; choose from {KV_DTYPES}")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    native = backend.prepare_native_kernels()
    print(
        f"native kernels: {'ready, variant ' + str(native_isa(args)) if native else 'unavailable'} "
        f"({time.perf_counter() - start:.1f} s to build or load)"
    )
    machine = measure_machine(args.repeats)
    print(
        f"read bandwidth {machine['read_bandwidth'] / 1e9:.1f} GB/s, matmul "
        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in machine["matmul_flops"].items())
    )
    results = []
    for dtype_name in filter(None, args.dtypes.split(",")):
        results += bench_decode(args, dtype_name, machine)
        results += bench_window(args, dtype_name, machine)
        if args.prefill_tokens > 0:
            results += bench_prefill(args, dtype_name, machine)
    if kv_names and native:
        for kv_name in kv_names:
            results.append(bench_decode_kv(args, kv_name, machine))
    report = {
        "provenance": provenance(args),
        "config": vars(args),
        "machine": machine,
        "results": results,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    table = markdown_table(results) if results else "(no rows)"
    lines = "\n".join(f"- {k}: `{json.dumps(v)}`" for k, v in report["provenance"].items())
    output.with_suffix(".md").write_text(
        f"# sparsekv bench kernels\n\n{table}\n\n## Provenance\n\n{lines}\n"
    )
    print(f"wrote {output} (+ .md)")
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sparsekv bench kernels [options]``."""
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
