"""``sparsekv bench kernels``: attention kernels against their memory or FLOP bound.

Measures the machine once (read bandwidth from a large fp32 sum, matmul FLOP/s per dtype), then
times, for the given shapes (default: SmolLM2 S1, 16 requests x 2000 tokens, 30 layers):

- paged decode attention, native vs the PyTorch reference, against the bandwidth bound of one
  step (bytes of K/V read / read bandwidth);
- the window-score pass over paged keys against the fp32 FLOP bound;
- with bf16: the fused AMX window-score kernel of decode-time compaction
  (``window_scores_fused_paged``: one call over ``--fused-layers`` stacked layers of one request
  holding ``--fused-slots`` slots; default SmolLM2 at a 1024-slot budget) against the larger of
  its bandwidth bound (key bytes) and FLOP bound (``Q K^T`` at the bf16 matmul rate); skipped
  with a message where the kernel does not run;
- prefill attention with LSE (``attention_with_lse`` vs ``CpuNativeBackend.prefill_attention``) against
  the FLOP bound of causal attention;
- the verification chunk kernel (``--chunk-rows`` rows per request over the held slots, one
  layer), each variant, against the larger of its bandwidth and FLOP bounds (``chunk.py``);
- with ``--kv-dtypes`` (e.g. ``bf16,int8,fp8,int4``), native paged decode over pages of each KV
  dtype at the same shape (int8 / fp8: ``kv_cache.quant`` codes and per-slot fp32 scales, read
  in place by ``quant_decode.paged_decode_attention_quantized``; int4: KIVI codes with fp16 per-channel
  key and per-slot value scales and zeros, ``quant_decode.paged_decode_attention_int4``): ms per step,
  bytes read per call (codes + scales) and the GB/s that makes. ``--dtypes ''`` skips the rows
  above;
- packed-weight matmuls on SmolLM2's Q4_1 / Q8_0 linears at each ``--packed-rows`` count of
  rows of x, each variant, against reading the packed weight once (``packed.py``).

``--list`` prints the CPU's kernel-relevant features and which variant each kernel family runs
and why (``bench/kernels/variants.py``), and exits.

Prints ms, bound and ratio per row and writes a JSON report (``--output``) with provenance and
the same rows as a Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import build, ops
from sparsekv.bench.kernels.chunk import bench_chunk
from sparsekv.bench.kernels.decode import bench_decode, bench_decode_kv
from sparsekv.bench.kernels.packed import bench_packed, packed_counts
from sparsekv.bench.kernels.pages import KV_DTYPES
from sparsekv.bench.kernels.prefill import bench_prefill
from sparsekv.bench.kernels.probe import DTYPES, measure_machine, native_isa
from sparsekv.bench.kernels.variants import print_variants
from sparsekv.bench.kernels.window import bench_window
from sparsekv.bench.kernels.window_fused import bench_window_fused
from sparsekv.cli_help import doc_parser
from sparsekv.evaluation.provenance import provenance as report_provenance
from sparsekv.evaluation.report import markdown_table


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench kernels", __doc__)
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
    parser.add_argument(
        "--fused-layers",
        type=int,
        default=28,
        help="layers stacked in the fused window-score call (bf16 only; 0 skips)",
    )
    parser.add_argument(
        "--fused-slots",
        type=int,
        default=1040,
        help="held slots per layer of the fused call (compaction at a 1024 budget + one block)",
    )
    parser.add_argument("--prefill-tokens", type=int, default=4000, help="0 skips prefill")
    parser.add_argument(
        "--chunk-rows",
        type=int,
        default=5,
        help="rows per request of the chunk-kernel rows (a K = 4 verification); 0 skips them",
    )
    parser.add_argument(
        "--packed-rows",
        default="1,5,16",
        help="rows of x of the packed-weight matmul rows (comma-separated); '' skips them",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (best is kept)")
    parser.add_argument("--no-reference", action="store_true", help="skip the torch_ref rows")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--isa",
        default=None,
        help="native kernel variant (default: the fastest this CPU runs; see ops.available_isas)",
    )
    parser.add_argument("--output", default="reports/kernels.json")
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the CPU features and which variant each kernel uses and why, then exit",
    )
    return parser


def provenance(args: argparse.Namespace) -> dict:
    """The shared report provenance (``evaluation.provenance``: git SHA and dirty flag,
    versions, threads, the CPU with its generation and flags, date, command line), plus the
    kernel variants this CPU runs and the one the decode rows used."""
    document = report_provenance()
    document["kernel_variants"] = list(ops.available_isas())
    document["kernel_variant_used"] = native_isa(args) if build.load_extension() else None
    return document


def bench_rows(
    args: argparse.Namespace, kv_names: list[str], native: bool, machine: dict
) -> list[dict]:
    """Every row of ``args`` in the printed order (the ``kv_names`` rows only when ``native``)."""
    results = []
    for dtype_name in filter(None, args.dtypes.split(",")):
        results += bench_decode(args, dtype_name, machine)
        results += bench_window(args, dtype_name, machine)
        if dtype_name == "bf16" and args.fused_layers > 0:
            results += bench_window_fused(args, machine)
        if args.prefill_tokens > 0:
            results += bench_prefill(args, dtype_name, machine)
        results += bench_chunk(args, dtype_name, machine)
    if kv_names and native:
        for kv_name in kv_names:
            results.append(bench_decode_kv(args, kv_name, machine))
    return results + bench_packed(args, machine)


def write_report(output: Path, report: dict) -> None:
    """The JSON report at ``output`` and its rows as a Markdown table at ``output``'s ``.md``."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    results = report["results"]
    table = markdown_table(results) if results else "(no rows)"
    lines = "\n".join(f"- {k}: `{json.dumps(v)}`" for k, v in report["provenance"].items())
    output.with_suffix(".md").write_text(
        f"# sparsekv bench kernels\n\n{table}\n\n## Provenance\n\n{lines}\n"
    )


def run(args: argparse.Namespace, machine: dict | None = None) -> dict:
    """Run every benchmark of ``args``, write the JSON and Markdown reports; returns the JSON.

    Args:
        args: parsed :func:`build_parser` options.
        machine: the probe's result (``read_bandwidth`` bytes/s, ``matmul_flops`` per dtype)
            to use instead of measuring it (:func:`probe.measure_machine`).

    Raises:
        ValueError: an unknown ``--kv-dtypes`` name, an ``--isa`` this CPU does not run,
            ``--fused-slots`` below ``--window``, a negative ``--chunk-rows`` or a bad
            ``--packed-rows``.
    """
    kv_names = list(filter(None, args.kv_dtypes.split(",")))
    unknown = sorted(set(kv_names) - set(KV_DTYPES))
    if unknown:
        raise ValueError(f"--kv-dtypes: unknown {unknown}; choose from {KV_DTYPES}")
    if args.chunk_rows < 0:
        raise ValueError(f"--chunk-rows: must be >= 0 (0 skips the rows), got {args.chunk_rows}")
    packed_counts(args.packed_rows)  # fails before any row is timed
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    native = CpuNativeBackend().prepare()
    print(
        f"native kernels: {'ready, variant ' + str(native_isa(args)) if native else 'unavailable'} "
        f"({time.perf_counter() - start:.1f} s to build or load)"
    )
    if machine is None:
        machine = measure_machine(args.repeats)
    print(
        f"read bandwidth {machine['read_bandwidth'] / 1e9:.1f} GB/s, matmul "
        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in machine["matmul_flops"].items())
    )
    report = {
        "provenance": provenance(args),
        "config": vars(args),
        "machine": machine,
        "results": bench_rows(args, kv_names, native, machine),
    }
    output = Path(args.output)
    write_report(output, report)
    print(f"wrote {output} (+ .md)")
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sparsekv bench kernels [options]``."""
    args = build_parser().parse_args(argv)
    if args.list:
        print_variants()
        return 0
    run(args)
    return 0
