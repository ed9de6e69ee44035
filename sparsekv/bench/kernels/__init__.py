"""``sparsekv bench kernels``: attention kernels against their memory or FLOP bound.

The command (parser, report) is ``cli``; the machine probe, timer and printed row ``probe``;
decode inputs ``pages``; one module of rows per kernel: ``decode``, ``window`` (paged window
scores), ``window_fused`` (the fused window scores of decode-time compaction), ``prefill``.
"""

from sparsekv.bench.kernels.cli import build_parser, main, provenance, run
from sparsekv.bench.kernels.decode import bench_decode, bench_decode_kv
from sparsekv.bench.kernels.pages import (
    KV_DTYPES,
    QUANTIZERS,
    decode_inputs,
    int4_bytes_per_call,
    make_int4_pages,
    make_pages,
)
from sparsekv.bench.kernels.prefill import bench_prefill
from sparsekv.bench.kernels.probe import DTYPES, best_time, measure_machine, native_isa, row, timed
from sparsekv.bench.kernels.window import bench_window
from sparsekv.bench.kernels.window_fused import bench_window_fused, fused_bound

__all__ = [
    "DTYPES",
    "KV_DTYPES",
    "QUANTIZERS",
    "bench_decode",
    "bench_decode_kv",
    "bench_prefill",
    "bench_window",
    "bench_window_fused",
    "best_time",
    "build_parser",
    "decode_inputs",
    "fused_bound",
    "int4_bytes_per_call",
    "main",
    "make_int4_pages",
    "make_pages",
    "measure_machine",
    "native_isa",
    "provenance",
    "row",
    "run",
    "timed",
]
