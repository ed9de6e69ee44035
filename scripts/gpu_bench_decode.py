"""Decode attention alone on a GPU: the Triton paged decode kernel against the bytes it must
read and the card's measured copy bandwidth (the HBM bound), with CUDA-event timing.

Default shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16) over
pages of 16 slots, batch 64 x 4096-token contexts (1 GiB of K/V read per call). A few launch
settings (tile width, warps, splits of the table) are swept; every result is appended to the
JSON file as soon as it exists. Needs only PyTorch and Triton.

    PYTHONPATH=. python scripts/gpu_bench_decode.py --out decode_bench.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def cuda_time(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls (CUDA events around the loop)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(num_bytes: int, iters: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters)
    return 2 * num_bytes / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096, help="slots per request")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("decode_bench.json"))
    args = parser.parse_args()

    from sparsekv.attention import torch_ref
    from sparsekv.attention.triton import decode

    results: dict = {"config": vars(args) | {"out": str(args.out)}, "runs": []}

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2))

    props = torch.cuda.get_device_properties(0)
    results["device"] = {"name": props.name, "sms": props.multi_processor_count}
    results["copy_bandwidth_gbs"] = copy_bandwidth(1 << 30, 20) / 1e9
    save()
    print(f"copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s", flush=True)

    dtype = getattr(torch, args.dtype)
    blocks = -(-args.context // args.block_size)
    num_pages = args.batch * blocks + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn(
        (num_pages, 2, args.num_kv_heads, args.block_size, args.head_dim),
        generator=gen, device="cuda", dtype=dtype,
    )  # fmt: skip
    tables = torch.randperm(num_pages - 1, device="cuda")[: args.batch * blocks]
    tables = tables.view(args.batch, blocks)
    seq_lens = torch.full((args.batch,), args.context, device="cuda", dtype=torch.long)
    query = torch.randn(
        (args.batch, args.num_heads, args.head_dim), generator=gen, device="cuda", dtype=dtype
    )
    scale = args.head_dim**-0.5
    element = pool.element_size()
    kv_bytes = args.batch * args.context * args.num_kv_heads * args.head_dim * 2 * element
    io_bytes = kv_bytes + 2 * query.numel() * element + tables.numel() * 8
    bound = io_bytes / (results["copy_bandwidth_gbs"] * 1e9)
    results["bytes_per_call"] = io_bytes
    results["hbm_bound_ms"] = bound * 1e3

    # Correctness on four requests against the reference before timing anything.
    out, lse, _ = decode.paged_decode_attention(query[:4], pool, tables[:4], seq_lens[:4], scale)
    ref_out, ref_lse, _ = torch_ref.paged_decode_attention(
        query[:4].float(), pool, tables[:4], seq_lens[:4], scale
    )
    results["max_abs_error_vs_reference"] = (out.float() - ref_out).abs().max().item()
    results["max_lse_error_vs_reference"] = (lse - ref_lse).abs().max().item()
    save()

    defaults = (decode.BLOCK_N, decode.NUM_WARPS)
    settings = [(None, 32, 4), (None, 64, 4), (None, 64, 8), (None, 128, 8), (2, 64, 4), (4, 64, 4)]
    for splits, block_n, warps in settings:
        decode.BLOCK_N, decode.NUM_WARPS = block_n, warps
        began = time.perf_counter()
        try:
            seconds = cuda_time(
                lambda splits=splits: decode.paged_decode_attention(
                    query, pool, tables, seq_lens, scale, num_splits=splits
                ),
                args.iters,
            )
        except Exception as error:  # a setting that does not compile is reported, not fatal
            results["runs"].append({"splits": splits, "block_n": block_n, "error": repr(error)})
            save()
            continue
        run = {
            "splits": splits or "auto",
            "block_n": block_n,
            "num_warps": warps,
            "ms": seconds * 1e3,
            "achieved_gbs": io_bytes / seconds / 1e9,
            "x_hbm_bound": seconds / bound,
            "wall_s_with_compile": time.perf_counter() - began,
        }
        results["runs"].append(run)
        save()
        print(json.dumps(run), flush=True)
    decode.BLOCK_N, decode.NUM_WARPS = defaults
    best = min((r for r in results["runs"] if "ms" in r), key=lambda r: r["ms"], default=None)
    results["best"] = best
    save()
    if best is not None:
        print(f"best {best['ms']:.3f} ms = {best['x_hbm_bound']:.2f}x the HBM bound", flush=True)


if __name__ == "__main__":
    main()
