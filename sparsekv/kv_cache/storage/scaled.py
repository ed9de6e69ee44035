"""int8 and fp8 pages: codes with one fp32 scale per (page, K/V, head, slot)."""

from __future__ import annotations

from dataclasses import replace

import torch

from sparsekv.attention.backends import DecodeParams, DecodeResult
from sparsekv.attention.paging import gather_kv, write_kv, write_leading_slots
from sparsekv.kv_cache import quant
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import cdiv
from sparsekv.kv_cache.storage.base import KVStorage, materialize


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
        codes = self.backend.allocate_pages(shape, self._code_dtype, self.device)
        scales = self.backend.allocate_pages(shape[:-1], torch.float32, self.device)
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
        self, query: torch.Tensor, params: DecodeParams, states: list[LayerKV]
    ) -> DecodeResult:
        """The backend reads the codes in place where it can
        (``AttentionBackend.supports_quantized_decode``); else the referenced pages are
        dequantized once and decoded densely."""
        params = self._local_params(params)
        if self.backend.supports_quantized_decode(query, self.codes, self.scales):
            return self.backend.paged_decode_quantized(query, self.codes, self.scales, params)
        dense, remapped = materialize(self.dequantize_pages, params.block_tables)
        return self.backend.paged_decode(query, dense, replace(params, block_tables=remapped))


def _quantize_fp8_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = quant.quantize_fp8(x)
    return codes.view(torch.uint8), scale


def _dequantize_fp8_bits(bits: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return quant.dequantize_fp8(bits.view(quant.FP8_DTYPE), scale, dtype)
