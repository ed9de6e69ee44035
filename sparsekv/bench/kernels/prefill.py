"""Prefill attention rows: ``torch_ref.attention_with_lse`` (explicit mask),
``CpuNativeBackend.prefill_attention``, ``TorchBackend.prefill_attention`` (PyTorch's flash
kernel for a whole prompt) and each native prefill variant this CPU runs for the dtype
(``prefill_ops.prefill_isas``: ``avx512_amx``, ``avx512_bf16``, ``avx512``, ``avx2``,
``generic``; fp32 on the last three), plus ``avx512_bf16`` with int8 Q·K^T where it runs
(``prefill_ops.prefill_qk_int8_runs``), over one layer, against the FLOP bound of causal
attention (bf16 rate: the int8 row's fraction above 1 is what its int8 half saved)."""

from __future__ import annotations

import argparse

import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.cpu import prefill_ops
from sparsekv.bench.kernels.probe import DTYPES, row, timed


def bench_prefill(args: argparse.Namespace, dtype_name: str, machine: dict) -> list[dict]:
    """Rows of one layer's prefill attention over ``--prefill-tokens`` positions."""
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
    backend = CpuNativeBackend()
    repeats = max(1, args.repeats // 2)
    variants = [
        row(
            f"prefill native {isa} {n} {dtype_name}",
            timed(
                lambda isa=isa: prefill_ops.prefill_attention(query, key, value, scale, isa=isa),
                repeats,
            ),
            bound,
            note,
        )
        for isa in prefill_ops.prefill_isas(dtype)
    ]
    if prefill_ops.prefill_qk_int8_runs(dtype, "avx512_bf16", d):
        variants.append(
            row(
                f"prefill native avx512_bf16 qk int8 {n} {dtype_name}",
                timed(
                    lambda: prefill_ops.prefill_attention(
                        query, key, value, scale, isa="avx512_bf16", qk_int8=True
                    ),
                    repeats,
                ),
                bound,
                note,
            )
        )
    return variants + [
        row(
            f"prefill attention_with_lse (mask) {n} {dtype_name}",
            timed(lambda: torch_ref.attention_with_lse(query, key, value, scale), repeats),
            bound,
            note,
        ),
        row(
            f"prefill backend {n} {dtype_name}",
            timed(lambda: backend.prefill_attention(query, key, value, scale), repeats),
            bound,
            note,
        ),
        row(
            f"prefill torch backend (flash, is_causal) {n} {dtype_name}",
            timed(lambda: TorchBackend().prefill_attention(query, key, value, scale), repeats),
            bound,
            note,
        ),
    ]
