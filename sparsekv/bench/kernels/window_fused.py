"""The fused window-score row: ``window_scores_fused_paged``, the kernel (AMX, AVX512-BF16, AVX2
or portable, whichever this CPU runs fastest) decode-time compaction runs (``runner/compaction.py``),
over one request's stacked layers.

One call reads every stacked layer's keys from the pages and returns each window row's
log-sum-exp and the summed window attention per slot (``attention/cpu/window_fused.py``). Its
bound is the larger of the bandwidth bound (key bytes read / read bandwidth) and the FLOP bound
(``2 x query heads x window x slots x head_dim`` of ``Q K^T`` at the bf16 matmul rate); the
exponentials are not counted.
"""

from __future__ import annotations

import argparse

import torch

from sparsekv.attention.cpu import window_fused
from sparsekv.bench.kernels.probe import row, timed


def fused_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of one compaction call, stacked as ``compaction.compact_from_pages`` stacks them.

    Returns:
        window queries ``[fused_layers * num_heads, window, head_dim]`` bf16 (layer-major),
        the pool ``[fused_layers * num_blocks, 2, num_kv_heads, block_size, head_dim]`` bf16
        and block tables ``[fused_layers, num_blocks]`` int64 of shuffled page ids, where
        ``num_blocks = ceil(fused_slots / block_size)``.
    """
    num_blocks = -(-args.fused_slots // args.block_size)
    num_pages = args.fused_layers * num_blocks
    shape = (num_pages, 2, args.num_kv_heads, args.block_size, args.head_dim)
    pool = torch.randn(shape).to(torch.bfloat16)
    tables = torch.randperm(num_pages).view(args.fused_layers, num_blocks).contiguous()
    num_query_heads = args.fused_layers * args.num_heads
    queries = torch.randn(num_query_heads, args.window, args.head_dim).to(torch.bfloat16)
    return queries, pool, tables


def fused_bound(args: argparse.Namespace, machine: dict) -> tuple[float, str, str]:
    """(bound in seconds, ``"bandwidth"`` or ``"FLOP"``: the larger bound, a note with both).

    Bytes: the keys of ``fused_slots`` slots per KV head and layer, bf16. FLOPs: ``Q K^T`` of
    every query head's ``window`` rows over every slot.
    """
    num_kv_rows = args.fused_layers * args.num_kv_heads * args.fused_slots
    key_bytes = num_kv_rows * args.head_dim * 2
    flops = 2 * args.fused_layers * args.num_heads * args.window * args.fused_slots * args.head_dim
    rate = machine["matmul_flops"]["bf16"]
    read_s, flop_s = key_bytes / machine["read_bandwidth"], flops / rate
    mb, gflop = f"{key_bytes / 1e6:.1f} MB of keys", f"{flops / 1e9:.2f} GFLOP"
    if read_s >= flop_s:
        return read_s, "bandwidth", f"bandwidth: {mb} > {gflop}"
    return flop_s, "FLOP", f"FLOP: {gflop} at {rate / 1e9:.0f} GFLOP/s > {mb}"


def bench_window_fused(args: argparse.Namespace, machine: dict) -> list[dict]:
    """The row of one fused window-score call over ``--fused-layers`` stacked layers of
    ``--fused-slots`` held slots (no LSE given: the kernel computes it, as compaction asks),
    or no row, with a message, where the kernel does not run (``--isa`` other than one of
    ``window_fused.VARIANTS``, or ``window_fused.supports_window_fused`` false).

    Raises:
        ValueError: ``--fused-slots`` below ``--window`` (each window row sees its own slot).
    """
    if args.fused_slots < args.window:
        raise ValueError(f"--fused-slots {args.fused_slots} < --window {args.window}")
    name = (
        f"window fused {args.fused_layers} layers {args.num_heads}h x{args.window} rows "
        f"x{args.fused_slots} slots bf16"
    )
    variants = " or ".join(window_fused.VARIANTS)
    if args.isa is not None and args.isa not in window_fused.VARIANTS:
        print(f"{name:<46} skipped: --isa {args.isa} (the kernel runs on {variants} only)")
        return []
    queries, pool, tables = fused_inputs(args)
    if not window_fused.supports_window_fused(queries, pool):
        print(
            f"{name:<46} skipped: the fused window kernel does not run here "
            "(window_fused.supports_window_fused: bf16, pages of a multiple of 16 slots, "
            f"head_dim a multiple of 32, a {variants} CPU)"
        )
        return []
    scale = args.head_dim**-0.5

    if args.isa is not None and args.isa not in window_fused.window_fused_isas():
        print(f"{name:<46} skipped: --isa {args.isa}: this CPU does not run that variant")
        return []

    def call() -> None:
        window_fused.window_scores_fused_paged(
            queries, pool, tables, args.fused_slots, None, scale, args.isa
        )

    bound, kind, note = fused_bound(args, machine)
    result = row(name, timed(call, args.repeats), bound, note)
    result["bound_kind"] = kind
    return [result]
