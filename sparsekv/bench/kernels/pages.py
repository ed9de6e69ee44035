"""Inputs of one decode step: K/V pages of each KV dtype, block tables and queries."""

from __future__ import annotations

import argparse

import torch

from sparsekv.attention.cpu.memory import advise_huge_pages
from sparsekv.bench.kernels.probe import DTYPES
from sparsekv.kv_cache import quant

QUANTIZERS = {"int8": quant.quantize_int8, "fp8": quant.quantize_fp8}
KV_DTYPES = (*DTYPES, *QUANTIZERS, "int4")


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
        advise_huge_pages(pool)  # as AttentionBackend.allocate_pages does for the engine
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
