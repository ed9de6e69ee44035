"""Window-score rows: the paged window-score kernel (native vs the reference) that SnapKV-family
scoring runs once the window rows' log-sum-exps are known, against the larger of its FLOP bound
(``Q K^T`` at the faster of the dtype's and fp32's matmul rates: bf16 runs on AMX tiles where the
CPU has them) and its bandwidth bound (the keys read once)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from sparsekv.attention.cpu import ops
from sparsekv.attention.reference import window_scores_paged as ref_window_scores
from sparsekv.bench.kernels.probe import DTYPES, native_and_reference_rows


def bench_window(args: argparse.Namespace, dtype_name: str, machine: dict) -> list[dict]:
    """Rows of ``--layers`` calls of the paged window-score kernel (one request, ``--window``
    rows per query head over ``--tokens`` slots, LSE given), native and reference."""
    dtype = DTYPES[dtype_name]
    num_slots = args.tokens
    num_blocks = -(-num_slots // args.block_size)
    pool = torch.randn(num_blocks, 2, args.num_kv_heads, args.block_size, args.head_dim).to(dtype)
    table = torch.randperm(num_blocks)
    queries = torch.randn(args.num_heads, args.window, args.head_dim).to(dtype)
    lse = torch.full((args.num_heads, args.window), 8.0)
    scale = args.head_dim**-0.5
    flops = 2 * args.num_heads * args.window * num_slots * args.head_dim * args.layers
    rate = max(machine["matmul_flops"][dtype_name], machine["matmul_flops"]["fp32"])
    key_bytes = args.num_kv_heads * num_slots * args.head_dim * pool.element_size() * args.layers
    flop_s, read_s = flops / rate, key_bytes / machine["read_bandwidth"]
    bound = max(flop_s, read_s)
    note = (
        f"{flops / 1e9:.2f} GFLOP at {rate / 1e9:.0f} GFLOP/s"
        if flop_s >= read_s
        else f"{key_bytes / 1e6:.1f} MB of keys"
    )
    label = f"{args.num_heads}h x{args.window} rows x{num_slots} slots x{args.layers} {dtype_name}"

    def run(fn: Callable) -> Callable[[], None]:
        return lambda: [fn(queries, lse, pool, table, num_slots, scale) for _ in range(args.layers)]

    return native_and_reference_rows(
        args,
        (f"window native {label}", f"window reference {label}"),
        run,
        ops.window_scores_paged,
        ref_window_scores,
        bound,
        note,
    )
