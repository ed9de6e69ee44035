"""The value object of a request's compression policy (``CompressionPolicy``).

``kv_cache.policy.resolve_policy`` builds one per request at admission; the scheduler, the KV
manager, the runner and the attention read it and never name a method (docs/internals.md,
"Compression policy").
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from dataclasses import dataclass, field

from sparsekv.compression.base import Compressor
from sparsekv.config import CompressionConfig
from sparsekv.kv_cache.plan import KVPolicy


def full_cache_kv() -> KVPolicy:
    """The KV manager's behaviour for a request without compression (its defaults)."""
    return KVPolicy(decode_eviction=True, bounded_chunks=False)


@dataclass(frozen=True)
class CompressionPolicy:
    """How one request's KV cache is compressed, resolved once (``resolve_policy``).

    A request with a full cache in every layer (method ``none``, ratio 0, or no layer
    budgeted) has ``settings = compressor = None`` and all-``None`` budgets.

    Attributes:
        settings: the request's merged, validated settings (window, pooling, kernel, scope,
            chunked mode, ...), or ``None`` for a full cache.
        compressor: the method's compressor (bound to the engine's tokenizer), or ``None``.
        layer_budgets: ``[num_layers]`` slots each layer keeps, window included; ``None``: a
            full cache (full-first-N and sliding-window layers, policy off). Empty on a
            tensor-parallel worker's mirror, whose budgets arrive with every step.
        kv: how the budgeted layers behave in the KV manager (decode eviction, bounded
            chunks, context-only compression).
        peak_pages: the most pages the request ever holds, per page kind (checked against
            the pool at admission).
        context_len: scope ``context``: the prompt's first ``context_len`` tokens are
            compressed once at their end; ``None``: the whole prompt is.
    """

    settings: CompressionConfig | None = None
    compressor: Compressor | None = None
    layer_budgets: tuple[int | None, ...] = ()
    kv: KVPolicy = field(default_factory=full_cache_kv)
    peak_pages: tuple[int, ...] = ()
    context_len: int | None = None

    @property
    def enabled(self) -> bool:
        """Some layer of the request is compressed."""
        return self.compressor is not None

    @property
    def window(self) -> int:
        """Observation window in tokens (1 without compression: no window to protect)."""
        return self.settings.window if self.settings is not None else 1

    @property
    def needs_attention_mass(self) -> bool:
        """The attention accumulates every query's attention mass (``Compressor`` docs)."""
        return self.compressor is not None and self.compressor.needs_attention_mass

    @property
    def evicts_randomly(self) -> bool:
        """The kept set depends on the request's random stream."""
        return self.compressor is not None and self.compressor.evicts_randomly

    @property
    def reconstructs(self) -> bool:
        """A compressing prefill step appends the compressor's reconstruction rows."""
        return self.compressor is not None and self.compressor.reconstructs

    @property
    def bounded_chunks(self) -> bool:
        """A chunked prefill is compressed after every chunk."""
        return self.kv.bounded_chunks

    def with_compressor(self, compressor: Compressor | None) -> CompressionPolicy:
        """The same policy run by another compressor object (a tensor-parallel rank's
        wrapper of the same method)."""
        return dataclasses.replace(self, compressor=compressor)

    def context_key(self, token_ids: list[int]) -> bytes | None:
        """Key of the compressed context shared between requests: its tokens, the per-layer
        budgets and every setting that changes which tokens are kept.

        Returns:
            The key, or ``None`` (never shared) without scope ``context``, for a randomly
            evicting method (the kept set depends on the seed) and for a context that is the
            whole prompt (the last prompt token must run to sample).
        """
        context_len, settings = self.context_len, self.settings
        if context_len is None or settings is None:
            return None
        if self.evicts_randomly or context_len >= len(token_ids):
            return None
        values = (
            settings.method,
            self.layer_budgets,
            settings.window,
            settings.pooling,
            settings.kernel_size,
            settings.gqa_agg,
            settings.chunked_mode,
            settings.head_budgets,
            settings.layer_scores,
        )
        hasher = hashlib.blake2b(repr(values).encode(), digest_size=16)
        hasher.update(array("q", token_ids[:context_len]).tobytes())
        return b"context:" + hasher.digest()
