"""Split-KV for decode: how many splits of a block table a launch uses, and the merge of the
splits' partial results by their log-sum-exp (FlashDecoding, Dao et al. 2023)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_SPLIT_SLOTS = 256  # a split walks at least this many slots (GPU)


@triton.jit
def merge_kernel(
    part_out_ptr, part_lse_ptr, num_splits, out_ptr, stride_ob, stride_oh, lse_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program per request: every head's split partials merged by their LSE (an empty
    split has ``lse = -inf`` and weighs nothing; a request with none gets zeros, ``-inf``)."""
    b = tl.program_id(0)
    heads = tl.arange(0, BLOCK_HEADS)
    head_mask = heads < NUM_HEADS
    splits = tl.arange(0, BLOCK_S)
    rows = (b * NUM_HEADS + heads).to(tl.int64)[:, None] * num_splits + splits[None, :]
    mask = head_mask[:, None] & (splits < num_splits)[None, :]
    lse_s = tl.load(part_lse_ptr + rows, mask=mask, other=float("-inf"))  # [heads, splits]
    top = tl.max(lse_s, 1)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse_s - safe_top[:, None])
    total = tl.sum(weights, 1)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    parts = tl.load(
        part_out_ptr + rows[:, :, None] * HEAD_DIM + dims[None, None, :],
        mask=mask[:, :, None] & dim_mask[None, None, :],
        other=0.0,
    )
    seen = total > 0
    out = tl.sum(parts * weights[:, :, None], 1) / tl.where(seen, total, 1.0)[:, None]
    lse = tl.where(seen, safe_top + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    out_mask = head_mask[:, None] & dim_mask[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(lse_ptr + b * NUM_HEADS + heads, lse, mask=head_mask)


def num_kv_splits(batch: int, num_kv_heads: int, table_slots: int, device: torch.device) -> int:
    """Splits of the table so that ``batch x num_kv_heads x splits`` programs fill the GPU
    twice over, each walking at least ``MIN_SPLIT_SLOTS`` slots (one split on the CPU)."""
    if device.type != "cuda":
        return 1
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(programs, max(batch * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(table_slots, MIN_SPLIT_SLOTS)))
