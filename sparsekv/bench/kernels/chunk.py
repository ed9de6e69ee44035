"""Verification chunk rows: ``chunk_paged.chunk_attention_paged_batch`` (the multi-query paged
kernel that scores a speculative step's ``K + 1`` rows, or a short prefill chunk, against the
held slots read in place), once per variant this CPU runs (``chunk_paged.chunk_isas``:
``avx512_amx``, ``avx512_bf16``, ``avx512``, ``avx2``, ``generic``), for ``--batch`` requests
of ``--chunk-rows`` rows over ``--tokens`` held slots each, on one layer; and the route the
backend takes past ``chunk_paged.beats_gather`` (each sequence's held slots gathered into a
copy, then the flash prefill kernel: the ``gather`` row), which sets the longest chunk the
kernel takes. The bound is the larger of reading the K/V once (bandwidth) and ``Q K^T`` +
``P V`` at the dtype's matmul rate."""

from __future__ import annotations

import argparse
import functools

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import chunk_paged
from sparsekv.bench.kernels.probe import DTYPES, row, timed


def chunk_bound(args: argparse.Namespace, dtype_name: str, machine: dict) -> tuple[float, str]:
    """(seconds, what bounds it) of one layer's chunk attention at ``args``' shape."""
    itemsize = DTYPES[dtype_name].itemsize
    kv_bytes = 2 * args.batch * args.num_kv_heads * args.tokens * args.head_dim * itemsize
    flops = 4 * args.batch * args.num_heads * args.chunk_rows * args.tokens * args.head_dim
    rate = max(machine["matmul_flops"][dtype_name], machine["matmul_flops"]["fp32"])
    read, compute = kv_bytes / machine["read_bandwidth"], flops / rate
    if read >= compute:
        return read, f"bandwidth: {kv_bytes / 1e6:.1f} MB of K/V"
    return compute, f"FLOP: {flops / 1e9:.2f} GFLOP at {rate / 1e9:.0f} GFLOP/s"


def bench_chunk(args: argparse.Namespace, dtype_name: str, machine: dict) -> list[dict]:
    """One row per chunk-kernel variant (none without the extension or for fp16)."""
    dtype = DTYPES[dtype_name]
    if args.chunk_rows <= 0 or dtype not in (torch.float32, torch.bfloat16):
        return []
    bs, batch, rows = args.block_size, args.batch, args.chunk_rows
    pages = -(-args.tokens // bs)
    generator = torch.Generator().manual_seed(0)
    shape = (batch * pages, 2, args.num_kv_heads, bs, args.head_dim)
    pool = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(batch * pages, generator=generator).view(batch, pages)
    query = torch.randn(args.num_heads, batch * rows, args.head_dim, generator=generator)
    key, value = torch.randn(2, args.num_kv_heads, batch * rows, args.head_dim).to(dtype)
    starts = torch.arange(batch + 1) * rows
    cached = torch.full((batch,), args.tokens)
    bound, note = chunk_bound(args, dtype_name, machine)
    call = functools.partial(
        chunk_paged.chunk_attention_paged_batch,
        query.to(dtype),
        key,
        value,
        pool,
        tables.contiguous(),
        starts,
        cached,
        args.head_dim**-0.5,
    )
    rows_out = [
        row(
            f"chunk {isa} {batch}x{rows} rows x{args.tokens} {dtype_name}",
            timed(functools.partial(call, isa=isa), args.repeats),
            bound,
            note,
        )
        for isa in chunk_paged.chunk_isas()
    ]
    backend = CpuNativeBackend()
    query_rows = query.to(dtype)

    def gather() -> None:
        for b in range(batch):  # the default route: gather, then the flash prefill kernel
            span = slice(b * rows, (b + 1) * rows)
            AttentionBackend.prefill_attention_paged(
                backend, query_rows[:, span], key[:, span], value[:, span], pool, tables[b],
                args.tokens, args.head_dim**-0.5,
            )  # fmt: skip

    name = f"chunk gather {batch}x{rows} rows x{args.tokens} {dtype_name}"
    return rows_out + [row(name, timed(gather, args.repeats), bound, note)]
