"""Full-precision page storage (``auto``): the base every quantized format specialises."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from sparsekv.attention.backends import AttentionBackend, DecodeParams, DecodeResult, create_backend
from sparsekv.attention.paging import gather_kv, write_leading_slots
from sparsekv.kv_cache import swap_copies
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import cdiv

# Up to this many slots a slot mapping is computed on Python ints (a verification writes K + 1
# rows per layer: 3.6 us against 13.2 us for the tensor arithmetic at 5 slots, Zen 5); longer
# chunks use tensors.
SMALL_SLOT_MAPPING = 16


class KVStorage:
    """Full-precision pages (``auto``): the base every format specialises.

    Args:
        num_pages: pages of this kind.
        page_offset: global id of this kind's first page.
        num_kv_heads, block_size, head_dim: page geometry.
        dtype: compute dtype (what ``gather`` returns; the stored dtype here).
        device: where pages live.
        backend: the engine's attention backend (decode, writes); ``None`` builds the
            ``auto`` one for ``device`` (direct construction in tests).
    """

    kv_cache_dtype = "auto"

    def __init__(
        self,
        num_pages: int,
        page_offset: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        backend: AttentionBackend | None = None,
    ) -> None:
        self.num_pages = num_pages
        self.page_offset = page_offset
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.backend = backend if backend is not None else create_backend("auto", self.device)
        self.tensors = self._allocate()

    def _allocate(self) -> list[torch.Tensor]:
        shape = (self.num_pages, 2, self.num_kv_heads, self.block_size, self.head_dim)
        return [self.backend.allocate_pages(shape, self.dtype, self.device)]

    @property
    def page_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    def head_view(self) -> KVStorage:
        """The same pages read as one KV head each: ``[num_pages, 2, 1, num_kv_heads *
        block_size, head_dim]`` (the head-wise layout of ``kv_cache.head_pages``), sharing
        this storage's memory; every method then takes one head's tables and slots.

        Raises:
            ValueError: a quantized format (head-wise pages are full precision).
        """
        if self.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype: head-wise pages need auto (full precision), got "
                f"{self.kv_cache_dtype}"
            )
        view = getattr(self, "_head_view", None)
        if view is None:
            view = object.__new__(type(self))
            view.__dict__.update(self.__dict__)
            view.num_kv_heads = 1
            view.block_size = self.num_kv_heads * self.block_size
            shape = (self.num_pages, 2, 1, view.block_size, self.head_dim)
            view.tensors = [self.tensors[0].view(shape)]
            self._head_view = view
        return view

    # ------------------------------------------------------------------ page ids
    def local(self, pages: list[int]) -> torch.Tensor:
        """Global page ids -> int64 indices into this storage's tensors.

        Through NumPy: ``torch.tensor`` of a list converts element by element (~285 us for
        the 1950 pages of a 30-layer compaction, ~80 us this way)."""
        ids = torch.from_numpy(np.array(pages, dtype=np.int64))
        if self.page_offset:
            ids -= self.page_offset
        return ids.to(self.device)

    def _local_tables(self, block_tables: torch.Tensor) -> torch.Tensor:
        # Padding entries (page 0) may belong to another kind; they are masked, any id serves.
        if self.page_offset == 0:
            return block_tables
        return (block_tables - self.page_offset).clamp_(min=0)

    def _slot_mapping(self, table: list[int], start: int, count: int) -> torch.Tensor:
        """Local physical slots of held slots ``start .. start + count - 1``."""
        bs = self.block_size
        if count <= SMALL_SLOT_MAPPING:  # a verification's K + 1 rows: Python ints, one tensor
            base = self.page_offset * bs
            slots = [table[s // bs] * bs + s % bs - base for s in range(start, start + count)]
            return torch.tensor(slots, dtype=torch.int64, device=self.device)
        first = start // self.block_size  # only the pages the slots fall in, not the whole table
        offset = start - first * self.block_size
        held = torch.arange(offset, offset + count, device=self.device)
        pages = self.local(table[first : cdiv(start + count, self.block_size)])
        return pages[held // self.block_size] * self.block_size + held % self.block_size

    # ------------------------------------------------------------------ writes
    def write_decode(self, slot_mapping: torch.Tensor, states: list[LayerKV], key, value) -> None:
        """Write one new token per request.

        Args:
            slot_mapping: ``[batch]`` int64 global physical slots (``page * block_size + off``).
            states: the requests' layer states (formats with a residual append there).
            key, value: ``[batch, num_kv_heads, head_dim]``.
        """
        self.write_rows(slot_mapping, key, value)

    def write_rows(
        self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Write rows at given physical slots (formats without per-request residuals; the
        batched chunk path of full-precision pages).

        Args:
            slot_mapping: ``[n]`` int64 global physical slots (``page * block_size + off``).
            key, value: ``[n, num_kv_heads, head_dim]`` in any float dtype.
        """
        local = slot_mapping
        if self.page_offset:
            local = slot_mapping - self.page_offset * self.block_size
        self._scatter(local, key, value)

    def _scatter(self, local_slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        # `.to` costs ~5 us even as a no-op (30 calls per decode step).
        if key.dtype != self.dtype or value.dtype != self.dtype:
            key, value = key.to(self.dtype), value.to(self.dtype)
        self.backend.write_kv(self.tensors[0], local_slots, key, value)

    def write_slots(
        self, state: LayerKV, table: list[int], start: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Write held slots ``start .. start + m - 1`` (appended after ``start`` held slots).

        Args:
            key, value: ``[num_kv_heads, m, head_dim]`` in any float dtype.
        """
        if key.shape[1] == 0:
            return
        mapping = self._slot_mapping(table, start, key.shape[1])
        self._scatter(mapping, key.transpose(0, 1), value.transpose(0, 1))

    def write_leading(
        self, state: LayerKV, table: list[int], key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Rewrite a compacted layer: ``m`` slots to held slots ``0 .. m - 1`` of ``table``.

        Args:
            key, value: ``[num_kv_heads, m, head_dim]``.
        """
        local = [page - self.page_offset for page in table]
        write_leading_slots(self.tensors[0], local, key, value)

    def write_kept(
        self,
        state: LayerKV,
        table: list[int],
        key: torch.Tensor,
        value: torch.Tensor,
        kept: torch.Tensor,
    ) -> None:
        """Compact a layer from its dense keys and values: rows ``kept[h]`` of head ``h`` to
        held slots ``0 .. k - 1`` of ``table`` (``write_leading`` of those rows).

        Plain pages of the compute dtype take the rows in one copy where the backend has that
        route (``AttentionBackend.supports_kept_slots``); quantized formats (their
        ``write_leading`` encodes) and the rest gather the rows first.

        Args:
            key, value: ``[num_kv_heads, n, head_dim]`` in the compute dtype.
            kept: ``[num_kv_heads, k]`` int64 row indices into ``n``.
        """
        pool = self.tensors[0]
        if self.kv_cache_dtype == "auto" and self.backend.supports_kept_slots(pool, key, value):
            pages = self.local(table[: cdiv(kept.shape[1], self.block_size)])
            self.backend.write_kept_slots(pool, pages, key, value, kept)
            return
        heads = torch.arange(kept.shape[0], device=kept.device)[:, None]
        self.write_leading(state, table, key[heads, kept], value[heads, kept])

    # ------------------------------------------------------------------ reads
    def gather(
        self, state: LayerKV, table: list[int], num_held: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Held slots of one (request, layer): keys, values ``[num_kv_heads, num_held,
        head_dim]`` in the compute dtype."""
        pages = self.local(table[: cdiv(num_held, self.block_size)])
        return gather_kv(self.tensors[0], pages, num_held)

    def reads_chunks_in_place(self) -> bool:
        """True when :meth:`chunk_attention` runs: full-precision pages, which hold exactly
        what a gather would return (quantized formats gather their dequantized slots)."""
        return self.kv_cache_dtype == "auto"

    def chunk_attention(
        self,
        table: list[int],
        num_held: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's attention over the layer's ``num_held`` held slots, read from the
        pages by the backend (``AttentionBackend.prefill_attention_paged``), and itself.

        Args:
            table: the layer's block table (global page ids).
            query: ``[num_heads, m, head_dim]``; key, value: ``[num_kv_heads, m, head_dim]``.
            others: as ``AttentionBackend.prefill_attention``.

        Returns:
            out ``[num_heads, m, head_dim]``, lse ``[num_heads, m]`` fp32.
        """
        pages = self.local(table[: cdiv(num_held, self.block_size)])
        return self.backend.prefill_attention_paged(
            query, key, value, self.tensors[0], pages, num_held, scale, sliding_window,
            logit_softcap,
        )  # fmt: skip

    def decode_attention(
        self, query: torch.Tensor, params: DecodeParams, states: list[LayerKV]
    ) -> DecodeResult:
        """One query per request over its pages.

        Args:
            query: ``[batch, num_heads, head_dim]``.
            params: the decode batch (``block_tables`` hold global page ids).
            states: the requests' layer states (formats with a residual read it).

        Returns:
            ``AttentionBackend.paged_decode``'s (out, lse, mass).
        """
        return self.backend.paged_decode(query, self.tensors[0], self._local_params(params))

    def _local_params(self, params: DecodeParams) -> DecodeParams:
        if self.page_offset == 0:
            return params
        return replace(params, block_tables=self._local_tables(params.block_tables))

    # ------------------------------------------------------------------ swap
    def read_pages(self, pages: list[int]) -> tuple[torch.Tensor, ...]:
        """Host copies of the pages' codes and scales (bit-exact; on CUDA pinned, copied on a
        side stream: ``swap_copies``)."""
        index = self.local(pages)
        return swap_copies.to_host([t.index_select(0, index) for t in self.tensors])

    def write_pages(self, pages: list[int], copy: tuple[torch.Tensor, ...]) -> None:
        """Restore ``read_pages`` copies into ``pages``."""
        if not pages:
            return
        index = self.local(pages)
        for tensor, saved in zip(self.tensors, swap_copies.to_device(copy, self.device)):
            tensor.index_copy_(0, index, saved)


def materialize(dequantize_pages, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize each page the block tables reference once: a dense pool of those pages and
    the tables renumbered into it."""
    unique, remapped = torch.unique(tables, return_inverse=True)
    return dequantize_pages(unique).contiguous(), remapped
