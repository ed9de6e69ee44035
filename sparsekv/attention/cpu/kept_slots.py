"""Prefill compaction in one copy: the kept rows of dense keys and values straight into pages.

A layer compressed at prefill holds its keys and values as dense activations. Gathering the
kept slots out of them (``keys[heads, kept]``) and then writing them to the layer's pages
(``torch_ref.write_leading_slots``) would copy twice; ``write_kept_slots`` writes each
kept row to its page slot directly (``csrc/compaction_binding.cpp``), with the same bytes in
the pages: a copy, no conversion.
"""

from __future__ import annotations

import torch

from sparsekv.attention.cpu import build
from sparsekv.attention.cpu.ops import NATIVE_DTYPES, _extension


def supports_kept_slots(kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """True when :func:`write_kept_slots` takes these tensors: CPU, keys and values in the
    pool's dtype (bf16 or fp32) with unit last stride, and the extension built."""
    return (
        kv_pool.dtype in NATIVE_DTYPES
        and key.dtype == value.dtype == kv_pool.dtype
        and kv_pool.device.type == key.device.type == value.device.type == "cpu"
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and build.load_extension() is not None
    )


def write_kept_slots(
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kept: torch.Tensor,
) -> None:
    """Write rows ``kept[h]`` of ``key[h]`` and ``value[h]`` to slots ``0 .. k - 1`` of the
    block table, per KV head ``h``: ``torch_ref.write_leading_slots(kv_pool, block_table,
    key[heads, kept], value[heads, kept])`` without the gathered copy, bit for bit. Slots
    past ``k`` in the last page are left as they were.

    Args:
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` contiguous (written).
        block_table: ``[>= ceil(k / block_size)]`` int64 local page ids.
        key, value: ``[num_kv_heads, n, head_dim]`` in the pool's dtype, unit last stride.
        kept: ``[num_kv_heads, k]`` int64 row indices into ``n`` (any order; slot ``j`` gets
            row ``kept[h, j]``).

    Raises:
        RuntimeError: a row or page id out of range, mismatched shapes or dtypes, or the
            extension is unavailable.
    """
    _extension().write_kept_slots_(kv_pool, block_table.contiguous(), key, value, kept.contiguous())
