"""Page storage: where the K/V of a page kind live, in full precision or quantized.

A ``KVStorage`` owns the tensors of one page kind: the codes
``[num_pages, 2 (K, V), num_kv_heads, block_size, head_dim]`` (int4: ``head_dim // 2`` bytes)
and, for quantized formats, the scales beside them. Page ids are global (``BlockPool`` kinds);
a storage subtracts its ``page_offset``. Everything above this module reads and writes K/V in
the model's compute dtype through the methods below, so attention and compression never see a
code or a scale:

- ``write_decode`` / ``write_slots`` / ``write_leading``: new slots, appended or compacted;
- ``write_kept``: a compaction's kept rows out of dense keys and values (prefill);
- ``gather``: a (request, layer)'s held slots, dequantized;
- ``decode_attention``: one query per request over its pages, on the engine's attention
  backend (``attention.backends``: a backend that reads int8/fp8/int4 pages in place does so;
  otherwise the referenced pages are dequantized once per call);
- ``read_pages`` / ``write_pages``: bit-exact copies for swapping.

Formats (``kv_cache.quant``): ``auto`` (the compute dtype), ``int8`` and ``fp8`` (one fp32 scale
per page, K/V, head and slot), ``int4`` (KIVI: keys per channel over a page's slots, values per
token, fp16 scale and zero). An int4 page is quantized when it is full; until then its slots
are the (request, layer)'s *residual* (``LayerKV.residual``), kept at full precision outside
the pool: the most recent ``num_held % block_size`` tokens, as KIVI keeps its recent tokens.
"""

from __future__ import annotations

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.kv_cache import quant
from sparsekv.kv_cache.storage.base import KVStorage
from sparsekv.kv_cache.storage.int4 import Int4Storage
from sparsekv.kv_cache.storage.scaled import ScaledStorage

__all__ = ["Int4Storage", "KVStorage", "ScaledStorage", "make_storage", "page_bytes"]


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


def make_storage(
    kv_cache_dtype: str,
    num_pages: int,
    page_offset: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
) -> KVStorage:
    """The storage of a format (``quant.KV_CACHE_DTYPES``) running on ``backend`` (``None``:
    the ``auto`` backend of ``device``).

    Raises:
        ValueError: an unknown format.
    """
    geometry = (num_pages, page_offset, num_kv_heads, block_size, head_dim, dtype, device, backend)
    if kv_cache_dtype == "auto":
        return KVStorage(*geometry)
    if kv_cache_dtype in ("int8", "fp8"):
        return ScaledStorage(kv_cache_dtype, *geometry)
    if kv_cache_dtype == "int4":
        return Int4Storage(*geometry)
    raise ValueError(
        f"kv_cache_dtype must be one of {quant.KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
    )
