"""Packed-weight matmul rows: the native GEMV (one row of x) and small-M GEMM (2-64 rows) of
``sparsekv.models.quant`` on SmolLM2-135M's packed linears (Q4_1 fused QKV ``960 x 576``, gate +
up ``3072 x 576``, down ``576 x 1536``; the Q8_0 output head ``49152 x 576``), with bf16
activations as the model runs them, at each ``--packed-rows`` count and on every packed-weight
variant this CPU runs (``avx512_amx``, ``avx512_vnni``, ``avx512_bf16``, ``avx2``, ``generic``;
``avx512_amx``, ``avx512_vnni`` and ``avx2`` also on the x16 group layout a bf16 model loads its
weights in there). Weights hold random codes with fp16 scales of 0.01; the bound is reading the
packed bytes once (bandwidth), which a call over weights already in cache can beat."""

from __future__ import annotations

import argparse
import functools

import torch

from sparsekv.bench.kernels.probe import row, timed
from sparsekv.models.quant import build as quant_build
from sparsekv.models.quant.formats import FORMATS, X16_FORMATS
from sparsekv.models.quant.ops import X16_VARIANTS

# (name, format, out_features, in_features) of SmolLM2-135M's packed linears
SHAPES = (
    ("qkv", "q4_1", 960, 576),
    ("gate_up", "q4_1", 3072, 576),
    ("down", "q4_1", 576, 1536),
    ("lm_head", "q8_0", 49152, 576),
)


def random_packed(fmt: str, out_features: int, in_features: int) -> torch.Tensor:
    """``uint8 [out_features, row_bytes]`` of random codes whose fp16 scale (and Q4_1 offset)
    is 0.01 in every block (Q4_0 / Q4_1 / Q8_0)."""
    layout = FORMATS[fmt]
    blocks = in_features // layout.block_values
    data = torch.randint(0, 256, (out_features, blocks, layout.block_bytes), dtype=torch.uint8)
    halves = 2 if fmt == "q4_1" else 1
    scale = torch.full((out_features, blocks, halves), 0.01, dtype=torch.float16)
    data[:, :, : 2 * halves] = scale.view(torch.uint8)
    return data.view(out_features, -1).contiguous()


def packed_counts(text: str) -> list[int]:
    """The row counts of ``--packed-rows`` (comma-separated; empty: none).

    Raises:
        ValueError: an entry that is not an integer >= 1 (the message names ``--packed-rows``).
    """
    try:
        counts = [int(m) for m in filter(None, text.split(","))]
    except ValueError:
        counts = [0]
    if any(m < 1 for m in counts):
        raise ValueError(f"--packed-rows: every count must be an integer >= 1, got {text!r}")
    return counts


def bench_packed(args: argparse.Namespace, machine: dict) -> list[dict]:
    """One row per (shape, rows of x, variant); none without the packed-weight extension.

    Raises:
        ValueError: a bad ``--packed-rows`` (:func:`packed_counts`).
    """
    counts = packed_counts(args.packed_rows)
    ext = quant_build.load_extension()
    if not counts or ext is None:
        return []
    isas = str(ext.available_isas()).split(",")
    results = []
    for name, fmt, n, k in SHAPES:
        weight = random_packed(fmt, n, k)
        bound = weight.numel() / machine["read_bandwidth"]
        note = f"bandwidth: {weight.numel() / 1e6:.2f} MB of {fmt}"
        code = FORMATS[fmt].code
        layouts = [(fmt, weight, code, isas)]
        x16_isas = [isa for isa in isas if isa in X16_VARIANTS]
        if x16_isas:
            x16 = X16_FORMATS[fmt]
            packed = ext.repack_x16(weight, code, k)
            layouts.append((x16, packed, FORMATS[x16].code, x16_isas))
        for m in counts:
            x = torch.randn(m, k).bfloat16()
            y = torch.empty(m, n, dtype=torch.bfloat16)
            for layout, data, layout_code, runs in layouts:
                for isa in runs:
                    call = functools.partial(ext.matmul_, x, data, layout_code, k, y, 0, isa, None)
                    label = f"packed {name} {layout} {n}x{k} m={m} {isa}"
                    results.append(row(label, timed(call, args.repeats), bound, note))
    return results
