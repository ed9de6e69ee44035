"""The page-write operations of the attention-backend interface (``AttentionBackend``).

Every step scatters its new keys and values into their pages; a compaction writes the kept
slots of dense keys and values into pages (prefill) or moves them between pages in place
(decode). ``AttentionBackend`` inherits these; implementations subclass ``AttentionBackend``,
not this class.
"""

from __future__ import annotations

import abc

import torch


class WriteOps(abc.ABC):
    """KV writes, kept-slot writes and slot moves (tensor conventions: ``AttentionBackend``)."""

    @abc.abstractmethod
    def write_kv(
        self,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Scatter new keys and values into their pages (in place).

        Args:
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
            slot_mapping: ``[num_tokens]`` int64 physical slot ``page * block_size + offset``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, converted to the pool dtype.
        """

    def supports_kept_slots(
        self, kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> bool:
        """True when :meth:`write_kept_slots` is a one-copy fast route for these tensors."""
        return False

    @abc.abstractmethod
    def write_kept_slots(
        self,
        kv_pool: torch.Tensor,
        block_table: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kept: torch.Tensor,
    ) -> None:
        """Compact dense keys and values into pages: rows ``kept[h]`` of ``key[h]`` /
        ``value[h]`` to slots ``0 .. k - 1`` of the block table, per KV head ``h``; slots past
        ``k`` in the last page are left as they were. Bytes are copied, not converted.

        Args:
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
            block_table: ``[>= ceil(k / block_size)]`` int64 page ids.
            key, value: ``[num_kv_heads, n, head_dim]`` in the pool's dtype.
            kept: ``[num_kv_heads, k]`` int64 row indices into ``n`` (any order).
        """

    @abc.abstractmethod
    def move_slots(
        self,
        kv_pool: torch.Tensor,
        source: torch.Tensor,
        target: torch.Tensor,
        kept: torch.Tensor,
    ) -> None:
        """Move the kept slots of each (layer, KV head) to slots ``0 .. k - 1`` of its target
        pages (decode-time compaction in place).

        Args:
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
            source: ``[layers, >= num_blocks]`` int64 pages holding the slots ``kept`` indexes.
            target: ``[layers, >= ceil(k / block_size)]`` int64 pages to write: fresh pages, or
                ``source``'s own first pages (in place).
            kept: ``[layers, num_kv_heads, k]`` int64 slot indices, ascending per row (what
                makes the in-place move safe); slot ``j`` of the result is ``kept[..., j]``.
        """
