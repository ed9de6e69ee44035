"""Decode-time compaction read from the pages in place (window-scored methods, plain pages).

A budgeted layer that reached ``budget + block_size`` slots is re-scored with its stored window
queries and compacted back to its budget (``PagedAttention.finish``). The general route gathers
the layer's keys and values out of the pages, scores the gathered copy and writes the kept slots
back. For SnapKV-family methods (``Compressor.window_scored``: the score is a function of the
summed window attention alone) over plain full-precision pages this module skips the copies:

1. the backend's paged window scores (``AttentionBackend.window_scores_paged``; on the native
   CPU backend the fused AMX / AVX512-BF16 kernel) read every layer's keys from the pages and
   return the summed window attention, computing each window row's log-sum-exp over the slots
   it sees on the way (one exponential per visible logit);
2. the layers' scores are stacked and ranked with one ``keep_top``;
3. the kept slots move page to page (``AttentionBackend.move_slots``; native: row copies in
   C++, one item per (layer, KV head)).

It applies where the backend says its paged route takes the tensors
(``supports_window_scores_paged``).

The result equals the general route's up to float rounding of the scores
(``tests/unit/test_compaction.py``: identical kept slots on the tested shapes).
"""

from __future__ import annotations

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.kv_cache.spec import cdiv
from sparsekv.kv_cache.storage import KVStorage
from sparsekv.runner.metadata import RequestSlice


def applies(
    request: RequestSlice,
    layers: list[int],
    storages: list[KVStorage],
    backend: AttentionBackend,
    logit_softcap: float | None = None,
) -> bool:
    """True when ``compact_from_pages`` takes these layers of ``request``: a window-scored
    compressor, no H2O accumulator, no attention soft-cap (the page-reading kernel scores
    uncapped logits), one plain (``auto``) page storage for all of them, and a backend whose
    paged window route takes the pool (``supports_window_scores_paged``)."""
    if logit_softcap is not None:
        return False
    compressor = request.compressor
    if compressor is None or not compressor.window_scored:
        return False
    first = request.kv.layers[layers[0]]
    if first.accumulated is not None or first.recent_queries is None:
        return False
    storage = storages[layers[0]]
    if any(storages[layer] is not storage for layer in layers):
        return False
    if storage.kv_cache_dtype != "auto":  # codes, not K/V (the pool's dtype is checked below)
        return False
    return backend.supports_window_scores_paged(first.recent_queries, storage.tensors[0])


def compact_from_pages(
    request: RequestSlice,
    layers: list[int],
    storages: list[KVStorage],
    scale: float,
    backend: AttentionBackend,
) -> None:
    """Re-score ``layers`` of ``request`` (equal slot counts and budgets, one storage) from
    their pages and compact each to its first ``budget`` slots (of its ``compact_table`` when
    copy-on-write).

    The layers are stacked: their query heads (layer-major, so each stays in its KV head's
    group) form one window query batch, their KV heads one key batch.
    """
    storage = storages[layers[0]]
    pool = storage.tensors[0]
    steps = [request.layers[layer] for layer in layers]
    num_slots = steps[0].num_held + 1  # the step's token was written by the decode path
    num_blocks = cdiv(num_slots, storage.block_size)
    tables = storage.local([page for step in steps for page in step.block_table[:num_blocks]])
    tables = tables.view(len(layers), num_blocks)
    queries = torch.cat([request.kv.layers[layer].recent_queries for layer in layers])
    summed, _ = backend.window_scores_paged(queries, pool, tables, num_slots, None, scale)
    num_kv_heads = storage.num_kv_heads
    compressor = request.compressor
    scores = compressor.score_window(summed, num_kv_heads * len(layers), queries.shape[1])
    kept = compressor.keep_top(scores, steps[0].compress_to, request.window, backend)
    num_kept_blocks = cdiv(kept.shape[1], storage.block_size)
    targets = [
        step.compact_table if step.compact_table is not None else step.block_table for step in steps
    ]
    target = storage.local([page for table in targets for page in table[:num_kept_blocks]])
    backend.move_slots(
        pool,
        tables,
        target.view(len(layers), num_kept_blocks),
        kept.view(len(layers), num_kv_heads, -1),
    )
