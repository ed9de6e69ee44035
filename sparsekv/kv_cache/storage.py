"""Page storage: where the K/V of a page kind live, in full precision or quantized.

A ``KVStorage`` owns the tensors of one page kind (CONTRACTS.md §2): the codes
``[num_pages, 2 (K, V), num_kv_heads, block_size, head_dim]`` (int4: ``head_dim // 2`` bytes)
and, for quantized formats, the scales beside them. Page ids are global (``BlockPool`` kinds);
a storage subtracts its ``page_offset``. Everything above this module reads and writes K/V in
the model's compute dtype through the methods below, so attention and compression never see a
code or a scale:

- ``write_decode`` / ``write_slots`` / ``write_leading``: new slots, appended or compacted;
- ``gather``: a (request, layer)'s held slots, dequantized;
- ``decode_attention``: one query per request over its pages (native kernels read int8/fp8
  pages in place; int4 and the fallbacks dequantize the referenced pages once per call);
- ``read_pages`` / ``write_pages``: bit-exact copies for swapping.

Formats (``kv_cache.quant``): ``auto`` (the compute dtype), ``int8`` and ``fp8`` (one fp32 scale
per page, K/V, head and slot), ``int4`` (KIVI: keys per channel over a page's slots, values per
token, fp16 scale and zero). An int4 page is quantized when it is full; until then its slots
are the (request, layer)'s *residual* (``LayerKV.residual``), kept at full precision outside
the pool: the most recent ``num_held % block_size`` tokens, as KIVI keeps its recent tokens.
"""

from __future__ import annotations

import torch

from sparsekv.attention import backend
from sparsekv.attention.torch_ref import gather_kv, write_kv, write_leading_slots
from sparsekv.kv_cache import quant
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import cdiv


def page_bytes(
    kv_cache_dtype: str, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one page (codes and scales) in a format; ``auto`` stores ``dtype``."""
    slots = num_kv_heads * block_size
    if kv_cache_dtype == "auto":
        return 2 * slots * head_dim * torch.empty((), dtype=dtype).element_size()
    if kv_cache_dtype in ("int8", "fp8"):
        return 2 * slots * (head_dim + 4)
    if kv_cache_dtype == "int4":
        # codes (two per byte), per-channel key scale + zero, per-token value scale + zero (fp16)
        return 2 * slots * head_dim // 2 + num_kv_heads * head_dim * 4 + slots * 4
    raise ValueError(
        f"kv_cache_dtype must be one of {quant.KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
    )


class KVStorage:
    """Full-precision pages (``auto``): the base every format specialises.

    Args:
        num_pages: pages of this kind.
        page_offset: global id of this kind's first page.
        num_kv_heads, block_size, head_dim: page geometry.
        dtype: compute dtype (what ``gather`` returns; the stored dtype here).
        device: where pages live.
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
    ) -> None:
        self.num_pages = num_pages
        self.page_offset = page_offset
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.tensors = self._allocate()

    def _allocate(self) -> list[torch.Tensor]:
        shape = (self.num_pages, 2, self.num_kv_heads, self.block_size, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device)]

    @property
    def page_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    # ------------------------------------------------------------------ page ids
    def local(self, pages: list[int]) -> torch.Tensor:
        """Global page ids -> int64 indices into this storage's tensors."""
        return torch.tensor(pages, dtype=torch.long, device=self.device) - self.page_offset

    def _local_tables(self, block_tables: torch.Tensor) -> torch.Tensor:
        # Padding entries (page 0) may belong to another kind; they are masked, any id serves.
        if self.page_offset == 0:
            return block_tables
        return (block_tables - self.page_offset).clamp_(min=0)

    def _slot_mapping(self, table: list[int], start: int, count: int) -> torch.Tensor:
        """Local physical slots of held slots ``start .. start + count - 1``."""
        held = torch.arange(start, start + count, device=self.device)
        pages = self.local(table)[held // self.block_size]
        return pages * self.block_size + held % self.block_size

    # ------------------------------------------------------------------ writes
    def write_decode(self, slot_mapping: torch.Tensor, states: list[LayerKV], key, value) -> None:
        """Write one new token per request.

        Args:
            slot_mapping: ``[batch]`` int64 global physical slots (``page * block_size + off``).
            states: the requests' layer states (formats with a residual append there).
            key, value: ``[batch, num_kv_heads, head_dim]``.
        """
        local = slot_mapping - self.page_offset * self.block_size
        self._scatter(local, key, value)

    def _scatter(self, local_slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        write_kv(self.tensors[0], local_slots, key, value)

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

    # ------------------------------------------------------------------ reads
    def gather(
        self, state: LayerKV, table: list[int], num_held: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Held slots of one (request, layer): keys, values ``[num_kv_heads, num_held,
        head_dim]`` in the compute dtype."""
        pages = self.local(table[: cdiv(num_held, self.block_size)])
        return gather_kv(self.tensors[0], pages, num_held)

    def decode_attention(
        self,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        first_slots: torch.Tensor,
        states: list[LayerKV],
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        return_attn_mass: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One query per request over its pages; arguments and results as
        ``backend.decode_attention`` (``block_tables`` hold global ids)."""
        return backend.decode_attention(
            query,
            self.tensors[0],
            self._local_tables(block_tables),
            seq_lens,
            scale,
            first_slots=first_slots,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            return_attn_mass=return_attn_mass,
        )

    # ------------------------------------------------------------------ swap
    def read_pages(self, pages: list[int]) -> tuple[torch.Tensor, ...]:
        """Host copies of the pages' codes and scales (bit-exact)."""
        index = self.local(pages)
        return tuple(t.index_select(0, index).to("cpu", copy=True) for t in self.tensors)

    def write_pages(self, pages: list[int], copy: tuple[torch.Tensor, ...]) -> None:
        """Restore ``read_pages`` copies into ``pages``."""
        if not pages:
            return
        index = self.local(pages)
        for tensor, saved in zip(self.tensors, copy):
            tensor.index_copy_(0, index, saved.to(self.device))


class ScaledStorage(KVStorage):
    """int8 or fp8 codes with one fp32 scale per (page, K/V, head, slot). fp8 codes are kept
    as their uint8 bit patterns (CPU copy kernels lack float8); ``codes`` views them as
    ``float8_e4m3fn``."""

    def __init__(self, kv_cache_dtype: str, *args, **kwargs) -> None:
        self.kv_cache_dtype = kv_cache_dtype
        if kv_cache_dtype == "int8":
            self._quantize, self._dequantize = quant.quantize_int8, quant.dequantize_int8
            self._code_dtype = torch.int8
        else:
            self._quantize, self._dequantize = _quantize_fp8_bits, _dequantize_fp8_bits
            self._code_dtype = torch.uint8
        super().__init__(*args, **kwargs)

    def _allocate(self) -> list[torch.Tensor]:
        shape = (self.num_pages, 2, self.num_kv_heads, self.block_size, self.head_dim)
        codes = torch.zeros(shape, dtype=self._code_dtype, device=self.device)
        scales = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)
        return [codes, scales]

    @property
    def codes(self) -> torch.Tensor:
        """``[num_pages, 2, num_kv_heads, block_size, head_dim]`` int8 or float8_e4m3fn."""
        codes = self.tensors[0]
        return codes.view(quant.FP8_DTYPE) if self.kv_cache_dtype == "fp8" else codes

    @property
    def scales(self) -> torch.Tensor:
        return self.tensors[1]

    def _scatter(self, local_slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        key_codes, key_scales = self._quantize(key)
        value_codes, value_scales = self._quantize(value)
        write_kv(self.tensors[0], local_slots, key_codes, value_codes)
        write_kv(
            self.scales[..., None], local_slots, key_scales[..., None], value_scales[..., None]
        )

    def write_leading(
        self, state: LayerKV, table: list[int], key: torch.Tensor, value: torch.Tensor
    ) -> None:
        local = [page - self.page_offset for page in table]
        key_codes, key_scales = self._quantize(key)
        value_codes, value_scales = self._quantize(value)
        write_leading_slots(self.tensors[0], local, key_codes, value_codes)
        write_leading_slots(
            self.scales[..., None], local, key_scales[..., None], value_scales[..., None]
        )

    def dequantize_pages(self, index: torch.Tensor) -> torch.Tensor:
        """``[len(index), 2, num_kv_heads, block_size, head_dim]`` pages in the compute dtype."""
        codes = self.tensors[0].index_select(0, index)
        return self._dequantize(codes, self.scales.index_select(0, index), self.dtype)

    def gather(
        self, state: LayerKV, table: list[int], num_held: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.local(table[: cdiv(num_held, self.block_size)])
        return gather_kv(self.dequantize_pages(pages), torch.arange(len(pages)), num_held)

    def decode_attention(
        self,
        query,
        block_tables,
        seq_lens,
        first_slots,
        states,
        scale,
        sliding_window,
        logit_softcap,
        return_attn_mass,
    ):
        tables = self._local_tables(block_tables)
        native = _native_quantized()
        if native is not None and native.supports_quantized(query, self.codes, self.scales):
            return native.paged_decode_attention_quantized(
                query,
                self.codes,
                self.scales,
                tables,
                seq_lens,
                scale,
                first_slots,
                sliding_window,
                logit_softcap,
                return_attn_mass,
            )
        dense, remapped = _materialize(self.dequantize_pages, tables)
        return backend.decode_attention(
            query,
            dense,
            remapped,
            seq_lens,
            scale,
            first_slots=first_slots,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            return_attn_mass=return_attn_mass,
        )


class Int4Storage(KVStorage):
    """KIVI int4 pages: keys per channel (per page and head), values per token; full pages
    only, the partial last page's slots stay in ``LayerKV.residual`` at full precision."""

    kv_cache_dtype = "int4"

    def _allocate(self) -> list[torch.Tensor]:
        n, h, bs, d = self.num_pages, self.num_kv_heads, self.block_size, self.head_dim
        if d % 2:
            raise ValueError(f"kv_cache_dtype int4 needs an even head_dim, got {d}")
        return [
            torch.zeros((n, 2, h, bs, d // 2), dtype=torch.uint8, device=self.device),
            torch.zeros((n, h, d), dtype=torch.float16, device=self.device),  # key scale
            torch.zeros((n, h, d), dtype=torch.float16, device=self.device),  # key zero
            torch.zeros((n, h, bs), dtype=torch.float16, device=self.device),  # value scale
            torch.zeros((n, h, bs), dtype=torch.float16, device=self.device),  # value zero
        ]

    def _store_pages(self, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Quantize full pages: key, value ``[num_kv_heads, len(index) * block_size, d]``."""
        h, bs, d = self.num_kv_heads, self.block_size, self.head_dim
        key = key.reshape(h, -1, bs, d).transpose(0, 1)  # [p, h, bs, d]
        value = value.reshape(h, -1, bs, d).transpose(0, 1)
        key_codes, key_scale, key_zero = quant.quantize_int4_keys(key)
        value_codes, value_scale, value_zero = quant.quantize_int4_values(value)
        codes = torch.stack((key_codes, value_codes), dim=1)
        for tensor, part in zip(
            self.tensors, (codes, key_scale, key_zero, value_scale, value_zero)
        ):
            tensor.index_copy_(0, index, part)

    def dequantize_pages(self, index: torch.Tensor) -> torch.Tensor:
        codes, key_scale, key_zero, value_scale, value_zero = (
            t.index_select(0, index) for t in self.tensors
        )
        keys = quant.dequantize_int4_keys(codes[:, 0], key_scale, key_zero, self.dtype)
        values = quant.dequantize_int4_values(codes[:, 1], value_scale, value_zero, self.dtype)
        return torch.stack((keys, values), dim=1)

    def write_decode(self, slot_mapping, states, key, value) -> None:
        for i, state in enumerate(states):
            self.write_slots(
                state, state.block_table, state.num_held, key[i, :, None], value[i, :, None]
            )

    def write_slots(self, state, table, start, key, value) -> None:
        bs = self.block_size
        residual = state.residual
        num_residual = 0 if residual is None else residual[0].shape[1]
        if num_residual != start % bs:
            raise AssertionError(f"int4 residual holds {num_residual} slots, expected {start % bs}")
        key, value = key.to(self.dtype), value.to(self.dtype)
        if residual is not None:
            key = torch.cat((residual[0], key), dim=1)
            value = torch.cat((residual[1], value), dim=1)
        first_page = start // bs
        num_full = key.shape[1] // bs
        if num_full:
            index = self.local(table[first_page : first_page + num_full])
            self._store_pages(index, key[:, : num_full * bs], value[:, : num_full * bs])
        rest = key.shape[1] - num_full * bs
        state.residual = None
        if rest:
            state.residual = (key[:, -rest:].contiguous(), value[:, -rest:].contiguous())

    def write_leading(self, state, table, key, value) -> None:
        state.residual = None
        self.write_slots(state, table, 0, key, value)

    def gather(self, state, table, num_held):
        num_full = num_held // self.block_size
        dense = self.dequantize_pages(self.local(table[:num_full]))
        keys, values = gather_kv(dense, torch.arange(num_full), num_full * self.block_size)
        if num_held > num_full * self.block_size:
            keys = torch.cat((keys, state.residual[0]), dim=1)
            values = torch.cat((values, state.residual[1]), dim=1)
        return keys, values

    def decode_attention(
        self,
        query,
        block_tables,
        seq_lens,
        first_slots,
        states,
        scale,
        sliding_window,
        logit_softcap,
        return_attn_mass,
    ):
        tables = self._local_tables(block_tables)
        dense, remapped = _materialize(self.dequantize_pages, tables)
        held_now = (seq_lens - first_slots).tolist()  # the new token included
        for i, state in enumerate(states):
            if state.residual is not None:
                num = state.residual[0].shape[1]
                page = remapped[i, held_now[i] // self.block_size]
                dense[page, 0, :, :num] = state.residual[0]
                dense[page, 1, :, :num] = state.residual[1]
        return backend.decode_attention(
            query,
            dense,
            remapped,
            seq_lens,
            scale,
            first_slots=first_slots,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            return_attn_mass=return_attn_mass,
        )


def _quantize_fp8_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = quant.quantize_fp8(x)
    return codes.view(torch.uint8), scale


def _dequantize_fp8_bits(bits: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return quant.dequantize_fp8(bits.view(quant.FP8_DTYPE), scale, dtype)


def _materialize(dequantize_pages, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize each page the block tables reference once: a dense pool of those pages and
    the tables renumbered into it."""
    unique, remapped = torch.unique(tables, return_inverse=True)
    return dequantize_pages(unique).contiguous(), remapped


def _native_quantized():
    """The native ops module when it offers quantized decode, else None."""
    from sparsekv.attention.cpu import ops

    return ops if hasattr(ops, "supports_quantized") else None


def make_storage(
    kv_cache_dtype: str,
    num_pages: int,
    page_offset: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> KVStorage:
    """The storage of a format (``quant.KV_CACHE_DTYPES``).

    Raises:
        ValueError: an unknown format.
    """
    geometry = (num_pages, page_offset, num_kv_heads, block_size, head_dim, dtype, device)
    if kv_cache_dtype == "auto":
        return KVStorage(*geometry)
    if kv_cache_dtype in ("int8", "fp8"):
        return ScaledStorage(kv_cache_dtype, *geometry)
    if kv_cache_dtype == "int4":
        return Int4Storage(*geometry)
    raise ValueError(
        f"kv_cache_dtype must be one of {quant.KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
    )
