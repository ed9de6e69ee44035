"""The page side of the KV cache: the pool, its page kinds, one storage per kind.

A quantized cache (``int8``, ``fp8``, ``int4``) may keep some layers in full precision; those
layers draw their pages from a second pool (page kind 1, format ``auto``) and every other layer
from the first (kind 0). ``KVPageStore`` owns the ``BlockPool`` and one ``KVStorage`` per kind,
knows each layer's kind, and answers the per-kind page counts every admission check makes
(does a step fit, can a request ever fit). It knows nothing of requests: ``KVCacheManager``
builds on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.budget import peak_request_pages
from sparsekv.kv_cache.plan import KVPolicy
from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.kv_cache.storage import KVStorage, make_storage


def every_layer_full_precision(num_layers: int, kv_cache_dtype: str) -> str:
    """The error message for a quantized format with no quantized layer left."""
    return (
        f"kv_cache_full_precision_layers: lists every layer ({num_layers}), so no layer is "
        f"{kv_cache_dtype}; use --kv-cache-dtype auto for a full-precision cache"
    )


def page_kinds(
    num_layers: int,
    num_pages: int | Sequence[int],
    kv_cache_dtype: str,
    full_precision_layers: Sequence[int],
) -> tuple[list[str], list[int], list[int]]:
    """The page kinds of a cache.

    Args:
        num_layers: layers of the model.
        num_pages: pages in the pool; with full-precision layers, a pair (quantized pages,
            full-precision pages).
        kv_cache_dtype: page format of kind 0 (``auto``, ``int8``, ``fp8`` or ``int4``).
        full_precision_layers: layers kept in full precision (ignored for ``auto``).

    Returns:
        Per kind its page format and its pool size, and the kind of every layer.

    Raises:
        ValueError: a full-precision layer out of range, every layer in full precision, or
            ``num_pages`` that does not match the number of kinds.
    """
    full = sorted(set(full_precision_layers)) if kv_cache_dtype != "auto" else []
    if any(not 0 <= layer < num_layers for layer in full):
        raise ValueError(
            f"kv_cache_full_precision_layers: {full} out of range for {num_layers} layers"
        )
    if full and len(full) == num_layers:
        raise ValueError(every_layer_full_precision(num_layers, kv_cache_dtype))
    formats = [kv_cache_dtype] + (["auto"] if full else [])
    sizes = [num_pages] if isinstance(num_pages, int) else list(num_pages)
    if len(sizes) != len(formats):
        raise ValueError(f"num_pages: {len(formats)} page kinds need {len(formats)} sizes")
    return formats, sizes, [int(layer in full) for layer in range(num_layers)]


class KVPageStore:
    """The page pool of every layer, split into page kinds, with one storage per kind.

    Args:
        layer_specs: one spec per model layer.
        num_pages: pages in the pool; with ``full_precision_layers``, a pair (quantized pages,
            full-precision pages).
        block_size: slots per page.
        num_kv_heads, head_dim: per-layer KV shape (same for all layers).
        dtype: the model's compute dtype (page storage dtype for ``auto``).
        device: where pages live.
        max_num_batched_tokens: step token budget (bounds a sliding layer's transient growth).
        kv_cache_dtype: page format, ``auto`` (= ``dtype``), ``int8``, ``fp8`` or ``int4``.
        full_precision_layers: layers whose pages stay in ``dtype`` when the format is
            quantized; they draw from a second pool (page kind 1).
        backend: the engine's attention backend every storage runs on (``None``: the
            ``auto`` backend of ``device``).

    Attributes:
        side_kind: the page kind whose pages stand for requests' side state
            (``kv_cache.side_state``): the one whose pool holds the most bytes.

    Raises:
        ValueError: an unknown format, a layer index out of range, every layer in full
            precision, or ``num_pages`` that does not match the number of page kinds.
    """

    def __init__(
        self,
        layer_specs: list[LayerSpec],
        num_pages: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        max_num_batched_tokens: int = 4096,
        kv_cache_dtype: str = "auto",
        full_precision_layers: Sequence[int] = (),
        backend: AttentionBackend | None = None,
    ) -> None:
        self.layer_specs = layer_specs
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        formats, sizes, self.layer_kinds = page_kinds(
            len(layer_specs), num_pages, kv_cache_dtype, full_precision_layers
        )
        self.pool = BlockPool(sizes)
        self.storages: list[KVStorage] = [
            make_storage(
                fmt, size, start, num_kv_heads, block_size, head_dim, dtype, device, backend
            )
            for fmt, size, start in zip(formats, sizes, self.pool.kind_starts)
        ]
        self.kv_cache_dtype = kv_cache_dtype
        self.max_num_batched_tokens = max_num_batched_tokens
        self._scratch: list[int] | None = None
        # The page kind whose pages stand for requests' side state (kv_cache.side_state): the
        # one whose pool holds the most bytes. With most layers kept in full precision, the
        # quantized pool is small while a request's side state is not.
        held = [size * storage.page_bytes for size, storage in zip(sizes, self.storages)]
        self.side_kind = max(range(len(held)), key=lambda kind: (held[kind], -kind))

    @property
    def num_layers(self) -> int:
        return len(self.layer_specs)

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get: free ones plus cached pages nobody holds (evictable)."""
        return self.pool.num_free_pages + self.pool.num_reclaimable_pages

    @property
    def num_total_pages(self) -> int:
        """Pages requests can hold: the pool less its scratch pages."""
        return self.pool.num_pages - len(self._scratch or ())

    def storage(self, layer: int) -> KVStorage:
        """The page storage a layer's block table indexes."""
        return self.storages[self.layer_kinds[layer]]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the main kind (codes and scales)."""
        return self.storages[0].page_bytes

    @property
    def side_page_bytes(self) -> int:
        """Bytes of one page of :attr:`side_kind`."""
        return self.storages[self.side_kind].page_bytes

    def scratch_pages(self) -> list[int]:
        """One page per kind that no request ever holds, taken from the pool on the first
        call: the padding rows of a static-shape decode batch write their K/V there.

        Returns:
            Per page kind, the global id of its scratch page.
        """
        if self._scratch is None:
            self._scratch = [self.pool.allocate(1, kind)[0] for kind in range(self.pool.num_kinds)]
        return self._scratch

    def fits(self, needed: list[int], watermark: int = 0) -> bool:
        """Whether every kind has ``needed[k] + watermark`` free or reclaimable pages."""
        return all(
            need == 0 or need + watermark <= self.pool.num_available(kind)
            for kind, need in enumerate(needed)
        )

    def _by_kind(self, per_layer: Sequence[int]) -> list[int]:
        """Per-layer page counts summed per page kind."""
        if self.pool.num_kinds == 1:
            return [sum(per_layer)]
        totals = [0] * self.pool.num_kinds
        for kind, count in zip(self.layer_kinds, per_layer):
            totals[kind] += count
        return totals

    def peak_pages(
        self, budgets: list[int | None], num_prompt_tokens: int, max_tokens: int, policy: KVPolicy
    ) -> list[int]:
        """Peak pages a request can hold per page kind, for the never-fits
        check against ``pool.kind_sizes``."""
        peaks = []
        for kind in range(self.pool.num_kinds):
            layers = [i for i, k in enumerate(self.layer_kinds) if k == kind]
            peaks.append(
                peak_request_pages(
                    [self.layer_specs[i] for i in layers],
                    [budgets[i] for i in layers],
                    num_prompt_tokens,
                    max_tokens,
                    self.block_size,
                    self.max_num_batched_tokens,
                    decode_eviction=policy.decode_eviction,
                    bounded_chunks=policy.bounded_chunks,
                    head_slack=self.num_kv_heads if policy.head_wise else 0,
                )
            )
        return peaks
