"""Index arithmetic of the page layout: scatter slots into pages, copy held slots out.

Pool ``[num_pages, 2 (K, V), num_kv_heads, block_size, head_dim]``; physical slot ``page *
block_size + offset``. These are layout helpers, not attention kernels: the page storage
(``kv_cache.storage``) uses them for every format's codes and scales, and ``torch_ref`` builds
on them. They are plain tensor indexing and run on any device and dtype.
"""

from __future__ import annotations

import torch


def write_kv(
    kv_pool: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Scatter new keys and values into their pages.

    Args:
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 physical slot = ``page * block_size + offset``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
    """
    block_size = kv_pool.shape[3]
    pages = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_pool[pages, 0, :, offsets] = key.to(kv_pool.dtype)
    kv_pool[pages, 1, :, offsets] = value.to(kv_pool.dtype)


def write_leading_slots(
    kv_pool: torch.Tensor, block_table: list[int], key: torch.Tensor, value: torch.Tensor
) -> None:
    """Write ``m`` slots' keys and values to logical slots ``0 .. m - 1`` of a block table
    (a compacted layer: ``first_slot`` 0). Whole pages go in one page-wise copy per half, the
    partial last page slot-wise; slots past ``m`` in that page are left as they were.

    Args:
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``.
        block_table: page ids, at least ``ceil(m / block_size)`` of them.
        key, value: ``[num_kv_heads, m, head_dim]``.
    """
    block_size = kv_pool.shape[3]
    num_kv_heads, m, head_dim = key.shape
    full = m // block_size
    if full:
        pages = torch.tensor(block_table[:full], dtype=torch.long, device=kv_pool.device)
        for half, rows in enumerate((key, value)):  # no stacked copy of the two
            paged = rows[:, : full * block_size].reshape(num_kv_heads, full, block_size, head_dim)
            kv_pool[pages, half] = paged.transpose(0, 1).to(kv_pool.dtype)
    rest = m - full * block_size
    if rest:
        page = block_table[full]
        kv_pool[page, 0, :, :rest] = key[:, full * block_size :].to(kv_pool.dtype)
        kv_pool[page, 1, :, :rest] = value[:, full * block_size :].to(kv_pool.dtype)


def gather_kv(
    kv_pool: torch.Tensor, block_table: torch.Tensor, num_held: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the held slots of one (request, layer) out of the pool.

    Args:
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``.
        block_table: ``[num_blocks]`` int64 page ids, first held page first.
        num_held: slots held (``num_slots - first_slot``).

    Returns:
        keys, values: ``[num_kv_heads, num_held, head_dim]`` in the pool dtype.
    """
    num_kv_heads, head_dim = kv_pool.shape[2], kv_pool.shape[4]
    if num_held == 0:
        empty = kv_pool.new_empty((num_kv_heads, 0, head_dim))
        return empty, empty
    pages = kv_pool.index_select(0, block_table)  # [nb, 2, kvh, bs, d]
    kv = pages.permute(1, 2, 0, 3, 4).reshape(2, num_kv_heads, -1, head_dim)
    return kv[0, :, :num_held], kv[1, :, :num_held]
