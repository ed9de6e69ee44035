"""Paged attention for one step: cache writes, attention, and compression inside the layer.

``PagedAttention.attend`` is what every model layer calls. Per layer it runs two paths:

- decode path: requests with one new token; their K/V are written into their pages and one
  batched paged-attention call reads the pages in place. A layer that reaches
  ``budget + block_size`` slots (decode-time eviction) is re-scored from its pages and
  compacted back to its budget after the forward (``finish``, ``runner.step_compression``): a
  request's compacting layers are scored together as one view with their heads stacked, one
  selection instead of one per layer (the layer's pages are not read again in the step);
- general path (prefill chunks, steps that compress, layers with head-wise pages:
  ``runner.headwise``; ``runner.general_attention``): earlier K/V are gathered, the new K/V
  appended as activations, attention returns each row's log-sum-exp, and a compressing layer
  scores the slots with the observation window (reusing that LSE), keeps the top ``budget``
  per KV head and writes only the kept K/V into its pages. A single-shot prefill therefore never
  writes a budgeted layer's uncompressed prompt into the pool, unless the step
  keeps it for the prefix cache (``LayerStep.keep_uncompressed``). A layer whose pages are
  shared compacts into the fresh pages of ``LayerStep.compact_table`` (copy-on-write).

A request whose compressor reconstructs (KVzip) brings reconstruction rows after its new
tokens in the step that compresses: every layer up to the last one that scores with them
attends them over its uncompressed slots (their outputs feed the next layer like any row), a
compressing layer hands them to the compressor, their K/V are never written, and then they
leave the forward (``rows_after``).

Side state kept per (request, layer) outside the pool: the last ``window`` queries of budgeted
layers (decode-time re-scoring) and H2O's accumulated attention mass.

Pages are read and written through each layer's ``KVStorage`` (``kv_cache.storage``), so the
same code runs over full-precision and quantized pages: scoring at prefill sees the new tokens'
full-precision keys (they are quantized only when written), decode-time re-scoring sees the
dequantized ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparsekv.attention.backends.base import AttentionBackend, DecodeParams
from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.kv_cache.storage import KVStorage
from sparsekv.runner import headwise, step_compression
from sparsekv.runner.attention_mass import accumulate_mass
from sparsekv.runner.chunk_batch import attend_chunk_batch
from sparsekv.runner.general_attention import attend_general
from sparsekv.runner.metadata import AttentionMetadata, RequestSlice
from sparsekv.runner.row_exit import drop_finished_rows


class PagedAttention:
    """The attention context of one step (an argument of the model's forward).

    Args:
        storages: the page storage of every layer (``KVCacheManager.storage(layer)``).
        metadata: this step's ``AttentionMetadata``.
        layer_specs: per-layer cache spec (sliding windows).
        backend: the engine's attention backend; the storages, the compressors (through
            ``LayerView.backend``) and compaction run on it.
        logit_softcap: optional attention logit soft-cap of the model.
        rope_frequencies: optional per-layer RoPE frequencies ``[rotary_dim // 2]`` (the
            model's ``rope_frequencies()``), handed to compressors in their ``LayerView``.
        query_buffer: a static context's ``[layers, max_batch, num_heads, head_dim]``
            buffer: the decode path copies every layer's queries into it (a tensor write a
            captured graph repeats) instead of keeping Python references, and takes no
            request-dependent branch; the owner logs them after the forward
            (``record_decode_step``). ``None`` for the eager context of a step.
        rebuild: builds the metadata of the step's slices again (``build_metadata`` with the
            runner's arguments) after rows leave the forward (``rows_after``); ``None``: rows
            never leave.

    Attributes:
        decode_scales: layer -> softmax scale its decode path was called with.
    """

    def __init__(
        self,
        storages: list[KVStorage],
        metadata: AttentionMetadata,
        layer_specs: list[LayerSpec],
        backend: AttentionBackend,
        logit_softcap: float | None = None,
        rope_frequencies: list[torch.Tensor] | None = None,
        query_buffer: torch.Tensor | None = None,
        rebuild: Callable[[list[RequestSlice]], AttentionMetadata] | None = None,
    ) -> None:
        self.storages = storages
        self.rebuild = rebuild
        # Layers after which some request's reconstruction rows leave (``rows_after``).
        self._row_exits = set()
        if rebuild is not None:
            self._row_exits = {s.reconstruction_until for s in metadata.slices if s.segments}
        self.query_buffer = query_buffer
        self.decode_scales: dict[int, float] = {}
        self.backend = backend
        self._pending: list[tuple[RequestSlice, int, float]] = []
        # Decode-path queries of budgeted layers, logged per request at ``finish``.
        self._step_queries: list[tuple[list[RequestSlice], int, torch.Tensor]] = []
        self.metadata = metadata
        self.layer_specs = layer_specs
        self.logit_softcap = logit_softcap
        self.rope_frequencies = rope_frequencies

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attention of the step's new tokens over their requests' caches.

        Args:
            layer: layer index.
            q: ``[num_tokens, num_heads, head_dim]`` post-RoPE queries.
            k, v: ``[num_tokens, num_kv_heads, head_dim]`` new keys (post-RoPE) and values.
            scale: softmax scale.
            sliding_window: the model's attention window for this layer in tokens (a query
                sees itself and the ``sliding_window - 1`` before it); ``None`` uses the layer
                spec's. The mask is the model's math, the spec only says which pages the cache
                may free, so a model can keep its window on a layer paged as ``full``; it must
                not exceed a ``sliding`` spec's window (those slots are gone).

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in the query dtype.
        """
        spec_window = self.layer_specs[layer].sliding_window
        assert sliding_window is None or spec_window is None or sliding_window <= spec_window
        window = sliding_window if sliding_window is not None else spec_window
        batch = self.metadata.decode[layer]
        storage = self.storages[layer]
        if batch is not None and batch.all_rows:
            # Decode-only step: every row is on the decode path, in order; no row gathers.
            return self._decode(batch, layer, q, k, v, scale, window, storage)
        out = torch.empty_like(q)
        if batch is not None:
            queries = q[batch.rows]
            out[batch.rows] = self._decode(
                batch, layer, queries, k[batch.rows], v[batch.rows], scale, window, storage
            )
        general = self.metadata.general[layer]
        if general:
            general = self._decode_heads(general, layer, q, k, v, scale, window, out)
        if len(general) > 1:  # several chunks read from the pages: one batched call
            general = attend_chunk_batch(self, general, layer, q, k, v, scale, window, out)
        for request in general:
            rows = slice(request.start, request.start + request.num_rows)
            out[rows] = attend_general(
                self, request, layer, q[rows], k[rows], v[rows], scale, window
            )
        return out

    def rows_after(self, layer: int) -> torch.Tensor | None:
        """``[kept_rows]`` int64 (on the CPU) rows of the batch the forward keeps after
        ``layer`` (``runner.row_exit``), or ``None`` to keep them all; the model indexes its
        per-row tensors with them."""
        if layer not in self._row_exits:
            return None
        kept = drop_finished_rows(self.metadata.slices, layer)
        if kept is None:
            return None
        self.metadata = self.rebuild(self.metadata.slices)
        return kept

    def _decode_heads(
        self,
        requests: list[RequestSlice],
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None,
        out: torch.Tensor,
    ) -> list[RequestSlice]:
        """Attend the one-token rows of the requests whose layer holds head-wise pages in one
        call (``headwise.decode_heads``); returns the requests left for the general path."""
        chosen, rest = [], []
        for r in requests:
            heads = r.num_rows == 1 and r.layers[layer].head_lens is not None
            (chosen if heads else rest).append(r)
        if not chosen:
            return requests
        rows = torch.tensor([r.start for r in chosen], dtype=torch.long, device=q.device)
        steps = [r.layers[layer] for r in chosen]
        storage = self.storages[layer]
        out[rows] = headwise.decode_heads(
            storage, steps, q[rows], k[rows], v[rows], scale, window, self.logit_softcap
        )
        return rest

    def _decode(
        self,
        batch,
        layer: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
        window: int | None,
        storage: KVStorage,
    ) -> torch.Tensor:
        """The decode path of one layer: ``queries`` ``[batch, H, d]`` (one row per request of
        ``batch``, in its order) and their new keys and values -> ``[batch, H, d]``."""
        states = [request.kv.layers[layer] for request in batch.slices]
        storage.write_decode(batch.slot_mapping, states, keys, values)
        params = DecodeParams(
            block_tables=batch.block_tables,
            seq_lens=batch.seq_lens,
            scale=scale,
            first_slots=batch.first_slots,
            sliding_window=window,
            logit_softcap=self.logit_softcap,
            return_attn_mass=batch.need_mass,
        )
        result, _, mass = storage.decode_attention(queries, params, states)
        self.decode_scales[layer] = scale
        if self.query_buffer is not None:
            self.query_buffer[layer, : queries.shape[0]].copy_(queries)
        elif batch.budgeted:
            self._step_queries.append((batch.slices, layer, queries))
        if batch.need_mass:
            for i, (request, state) in enumerate(zip(batch.slices, states)):
                if state.budget is not None and request.needs_attention_mass:
                    held = request.layers[layer].num_held + 1
                    accumulate_mass(state, mass[i, :, :held])
        self._pending.extend((request, layer, scale) for request in batch.compacting)
        return result

    def record_decode_step(
        self,
        slices: list[RequestSlice],
        queries: dict[int, torch.Tensor],
        compacting: list[tuple[RequestSlice, int, float]],
    ) -> None:
        """Adopt a decode step whose forward ran in a static context: ``finish`` then logs
        ``queries`` (layer -> ``[len(slices), num_heads, head_dim]``, read before ``finish``
        returns) for the budgeted layers' windows and runs the ``compacting`` (request, layer,
        scale) compactions, as after an eager forward of the same step."""
        self._step_queries.extend((slices, layer, q) for layer, q in queries.items())
        self._pending.extend(compacting)

    def _log_decode_queries(self) -> None:
        """Hand each decode request its rows of the step's queries: the layers that shared a
        decode batch are stacked once (``[layers, batch, num_heads, head_dim]``) and every
        request logs the stack with its row (``RequestKV.log_decode_queries``)."""
        groups: dict[int, tuple[list[RequestSlice], list[int], list[torch.Tensor]]] = {}
        for slices, layer, queries in self._step_queries:
            _, layers, tensors = groups.setdefault(id(slices), (slices, [], []))
            layers.append(layer)
            tensors.append(queries)
        self._step_queries = []
        for slices, layers, tensors in groups.values():
            stacked = torch.stack(tensors)
            layer_ids = tuple(layers)
            for row, request in enumerate(slices):
                request.kv.log_decode_queries(stacked, row, layer_ids, request.window)

    def finish(self) -> None:
        """Log the step's decode queries for the recent-query windows, then run the step's
        decode-time compactions (call once after the model's forward;
        ``step_compression.compact_pending``)."""
        self._log_decode_queries()
        pending, self._pending = self._pending, []
        step_compression.compact_pending(self, pending)
