"""Page writes in Triton: new K/V by slot mapping, kept rows of a compaction, slot moves.

- ``write_kv``: ``torch_ref.write_kv`` (one program per token, every KV head); a negative
  slot is skipped, so padding rows of a captured batch can point at ``-1`` (vLLM's
  convention) instead of a scratch page.
- ``write_kept_slots``: ``AttentionBackend.write_kept_slots`` (prefill compaction: kept rows of
  the dense K/V straight into the first slots of the block table).
- ``move_slots``: ``AttentionBackend.move_slots`` (decode-time compaction page to page, in place or
  into fresh pages). One program walks a whole (layer, KV head) in order, a tile at a time,
  with a barrier between a tile's loads and its stores: kept slots ascend, so slot ``j``
  (written) never comes after ``kept[j]`` (read), and a tile only overwrites slots below every
  slot later tiles read. Other programs touch other heads' rows or other layers' pages.

Writes copy bytes converted to the pool's dtype (a copy, no rounding, when the dtypes match).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.attention.triton.common import check_device, pool_strides

BLOCK_ROWS = 32


@triton.jit
def _write_kv_kernel(
    key_ptr, stride_kt, stride_kh, value_ptr, stride_vt, stride_vh, slot_ptr,
    pool_ptr, stride_page, stride_kv, stride_head, stride_slot, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :] & (slot >= 0)
    slot = tl.maximum(slot, 0)
    base = pool_ptr + (slot // BLOCK_SIZE) * stride_page + (slot % BLOCK_SIZE) * stride_slot
    dest = base + heads[:, None] * stride_head + dims[None, :]
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask)
    value = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask
    )
    tl.store(dest, key.to(pool_ptr.dtype.element_ty), mask=mask)
    tl.store(dest + stride_kv, value.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_rows_kernel(
    key_ptr, stride_kh, stride_kn, value_ptr, stride_vh, stride_vn, kept_ptr, stride_ch,
    num_kept, table_ptr, pool_ptr, stride_page, stride_kv, stride_head, stride_slot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    slots = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    dims = tl.arange(0, BLOCK_D)
    slot_mask = slots < num_kept
    mask = slot_mask[:, None] & (dims < HEAD_DIM)[None, :]
    rows = tl.load(kept_ptr + head * stride_ch + slots, mask=slot_mask, other=0).to(tl.int64)
    page = tl.load(table_ptr + slots // BLOCK_SIZE, mask=slot_mask, other=0).to(tl.int64)
    base = pool_ptr + page * stride_page + head * stride_head + (slots % BLOCK_SIZE) * stride_slot
    dest = base[:, None] + dims[None, :]
    key = tl.load(key_ptr + head * stride_kh + rows[:, None] * stride_kn + dims[None, :], mask)
    value = tl.load(value_ptr + head * stride_vh + rows[:, None] * stride_vn + dims[None, :], mask)
    tl.store(dest, key.to(pool_ptr.dtype.element_ty), mask=mask)
    tl.store(dest + stride_kv, value.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _move_slots_kernel(
    pool_ptr, stride_page, stride_kv, stride_head, stride_slot, source_ptr, stride_sl,
    target_ptr, stride_tl, kept_ptr, stride_cl, stride_ch, num_kept,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    layer = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    kept_row = kept_ptr + layer * stride_cl + head * stride_ch
    head_base = pool_ptr + head * stride_head
    tile = 0
    while tile < num_kept:  # in order: see the module docstring
        slots = tile + tl.arange(0, BLOCK_ROWS)
        slot_mask = slots < num_kept
        mask = slot_mask[:, None] & dim_mask[None, :]
        src = tl.load(kept_row + slots, mask=slot_mask, other=0).to(tl.int64)
        src_page = tl.load(source_ptr + layer * stride_sl + src // BLOCK_SIZE, mask=slot_mask)
        src_ptrs = head_base + src_page.to(tl.int64) * stride_page
        src_ptrs = (src_ptrs + (src % BLOCK_SIZE) * stride_slot)[:, None] + dims[None, :]
        key = tl.load(src_ptrs, mask=mask)
        value = tl.load(src_ptrs + stride_kv, mask=mask)
        dst_page = tl.load(target_ptr + layer * stride_tl + slots // BLOCK_SIZE, mask=slot_mask)
        dst_ptrs = head_base + dst_page.to(tl.int64) * stride_page
        dst_ptrs = (dst_ptrs + (slots % BLOCK_SIZE) * stride_slot)[:, None] + dims[None, :]
        tl.debug_barrier()
        tl.store(dst_ptrs, key, mask=mask)
        tl.store(dst_ptrs + stride_kv, value, mask=mask)
        tl.debug_barrier()
        tile += BLOCK_ROWS


def write_kv(
    kv_pool: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Scatter new keys and values into their pages (``torch_ref.write_kv``).

    Args:
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written), unit last
            stride.
        slot_mapping: ``[num_tokens]`` int physical slot ``page * block_size + offset``; a
            negative slot is skipped.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, unit last stride.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    check_device(kv_pool, slot_mapping, key, value)
    if num_tokens == 0:
        return
    stride_page, stride_kv, stride_head, stride_slot = pool_strides(kv_pool)
    _write_kv_kernel[(num_tokens,)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        slot_mapping, kv_pool, stride_page, stride_kv, stride_head, stride_slot, num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=kv_pool.shape[3],
    )  # fmt: skip


def write_kept_slots(
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kept: torch.Tensor,
) -> None:
    """Write rows ``kept[h]`` of ``key[h]`` / ``value[h]`` to held slots ``0 .. k - 1`` of the
    block table, per KV head (``AttentionBackend.write_kept_slots``); slots past ``k`` in the
    last page keep what they held.

    Args:
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
        block_table: ``[>= ceil(k / block_size)]`` int page ids.
        key, value: ``[num_kv_heads, n, head_dim]``, unit last stride.
        kept: ``[num_kv_heads, k]`` int row indices into ``n`` (any order).
    """
    num_kv_heads, num_kept = kept.shape
    check_device(kv_pool, block_table, key, value, kept)
    if num_kept == 0:
        return
    kept, table = kept.contiguous(), block_table.contiguous()
    head_dim = key.shape[2]
    _write_rows_kernel[(num_kv_heads, triton.cdiv(num_kept, BLOCK_ROWS))](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), kept,
        kept.stride(0), num_kept, table, kv_pool, *pool_strides(kv_pool), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_pool.shape[3],
        BLOCK_ROWS=BLOCK_ROWS,
    )  # fmt: skip


def move_slots(
    pool: torch.Tensor, source: torch.Tensor, target: torch.Tensor, kept: torch.Tensor
) -> None:
    """Move the kept slots of each (layer, KV head) to slots ``0 .. k - 1`` of its target
    pages (``AttentionBackend.move_slots``).

    Args:
        pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
        source: ``[layers, >= num_blocks]`` int pages holding the slots ``kept`` indexes.
        target: ``[layers, >= ceil(k / block_size)]`` int pages to write: fresh pages, or
            ``source``'s own first pages (in place).
        kept: ``[layers, num_kv_heads, k]`` int slot indices, ascending per row.
    """
    num_layers, num_kv_heads, num_kept = kept.shape
    check_device(pool, source, target, kept)
    if num_kept == 0:
        return
    source, target, kept = source.contiguous(), target.contiguous(), kept.contiguous()
    head_dim = pool.shape[4]
    _move_slots_kernel[(num_layers, num_kv_heads)](
        pool, *pool_strides(pool), source, source.stride(0), target, target.stride(0), kept,
        kept.stride(0), kept.stride(1), num_kept, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=pool.shape[3],
        BLOCK_ROWS=BLOCK_ROWS,
    )  # fmt: skip
