"""Paged decode attention rows: native vs the PyTorch reference per query dtype, and native over
pages of each KV dtype (fp32, bf16, int8, fp8, int4) with the bytes each call reads."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.cpu import ops, quant_decode
from sparsekv.bench.kernels.pages import (
    decode_inputs,
    int4_bytes_per_call,
    make_int4_pages,
    make_pages,
)
from sparsekv.bench.kernels.probe import (
    DTYPES,
    native_and_reference_rows,
    native_isa,
    row,
    timed,
)


def decode_case(args: argparse.Namespace, dtype_name: str) -> tuple[list, Callable]:
    """Inputs of one decode step over all layers: per-layer (query, block table), and a
    function making one step's callable for an attention over the step's pool."""
    pool, _ = make_pages(args, dtype_name)
    layers, seq_lens = decode_inputs(args, DTYPES[dtype_name])
    scale = args.head_dim**-0.5

    def step(attention: Callable) -> Callable[[], None]:
        def run() -> None:
            for query, table in layers:
                attention(query, pool, table, seq_lens, scale)

        return run

    return layers, step


def bench_decode(args: argparse.Namespace, dtype_name: str, machine: dict) -> list[dict]:
    """Rows of one decode step over every layer (native and ``torch_ref``) against the
    bandwidth bound of the K/V bytes it reads."""
    dtype = DTYPES[dtype_name]
    layers, step = decode_case(args, dtype_name)
    kv_bytes = 2 * args.batch * args.tokens * args.num_kv_heads * args.head_dim * args.layers
    kv_bytes *= torch.finfo(dtype).bits // 8
    bound = kv_bytes / machine["read_bandwidth"]
    note = f"{kv_bytes / 1e6:.0f} MB of K/V"
    label = f"{args.batch}x{args.tokens} x{args.layers} layers {dtype_name}"
    return native_and_reference_rows(
        args,
        (f"decode native {label}", f"decode torch_ref {label}"),
        step,
        ops.paged_decode_attention,
        torch_ref.paged_decode_attention,
        bound,
        note,
        reference_repeats=max(1, args.repeats // 2),
    )


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
        quant_decode.paged_decode_attention_quantized, kv_data=data, kv_scales=scales, isa=isa
    )
    return attend, bytes_per_call + slots * scales.element_size()


def int4_attention(args: argparse.Namespace) -> tuple[Callable, int]:
    """Native decode over the int4 pages of one step (bound to them) and the bytes one layer's
    call reads (:func:`int4_bytes_per_call`)."""
    names = ("codes", "key_scale", "key_zero", "value_scale", "value_zero")
    tensors = dict(zip(names, make_int4_pages(args)))
    attend = functools.partial(
        quant_decode.paged_decode_attention_int4, **tensors, isa=native_isa(args)
    )
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
