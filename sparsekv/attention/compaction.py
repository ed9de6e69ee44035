"""Decode-time compaction read from the pages in place (window-scored methods, plain pages).

A budgeted layer that reached ``budget + block_size`` slots is re-scored with its stored window
queries and compacted back to its budget (``PagedAttention.finish``). The general route gathers
the layer's keys and values out of the pages, scores the gathered copy and writes the kept slots
back. For SnapKV-family methods (``Compressor.window_scored``: the score is a function of the
summed window attention alone) over plain full-precision pages this module skips the copies:

1. each window row's log-sum-exp over the slots it sees comes from the AMX prefill kernel
   (``ops.prefill_attention``: the window rows are the last ``w`` of ``n`` causal positions),
   over the layer's keys alone (the output is discarded);
2. the summed window attention is read from the pages by the paged window-score kernel;
3. the layers' scores are stacked and ranked with one ``keep_top``;
4. the kept slots move page to page (one ``index_select`` and one ``index_copy_`` per layer).

The result equals the general route's up to the log-sum-exp's rounding (its scores come from
the same kernel; ``tests/unit/test_compaction.py``).
"""

from __future__ import annotations

import torch

from sparsekv.attention.cpu import ops as native
from sparsekv.attention.metadata import RequestSlice
from sparsekv.kv_cache.spec import cdiv
from sparsekv.kv_cache.storage import KVStorage


def applies(request: RequestSlice, layers: list[int], storages: list[KVStorage]) -> bool:
    """True when ``compact_from_pages`` takes these layers of ``request``: a window-scored
    compressor, no H2O accumulator, one plain (``auto``) bf16 page storage for all of them and
    the native kernels."""
    compressor = request.compressor
    if compressor is None or not compressor.window_scored:
        return False
    first = request.kv.layers[layers[0]]
    if first.accumulated is not None or first.recent_queries is None:
        return False
    storage = storages[layers[0]]
    if any(storages[layer] is not storage for layer in layers):
        return False
    if storage.kv_cache_dtype != "auto" or storage.dtype != torch.bfloat16:
        return False
    queries, pool = first.recent_queries, storage.tensors[0]
    probe = pool.new_empty(storage.num_kv_heads, 1, pool.shape[-1])
    return native.supports(queries, pool) and native.supports_prefill(queries[:, :1], probe)


def compact_from_pages(
    request: RequestSlice, layers: list[int], storages: list[KVStorage], scale: float
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
    keys = _stacked_keys(pool, tables, num_slots)
    _, lse = native.prefill_attention(queries, keys, keys, scale)
    num_kv_heads = storage.num_kv_heads
    group = queries.shape[0] // keys.shape[0]
    summed = torch.cat(
        [
            native.window_scores_paged(
                queries[i * num_kv_heads * group : (i + 1) * num_kv_heads * group],
                lse[i * num_kv_heads * group : (i + 1) * num_kv_heads * group],
                pool,
                tables[i],
                num_slots,
                scale,
            )
            for i in range(len(layers))
        ]
    )
    compressor = request.compressor
    scores = compressor.score_window(summed, keys.shape[0], queries.shape[1])
    kept = compressor.keep_top(scores, steps[0].compress_to, request.window)
    targets = [
        step.compact_table if step.compact_table is not None else step.block_table for step in steps
    ]
    num_target_blocks = cdiv(kept.shape[1], storage.block_size)
    target = storage.local([page for table in targets for page in table[:num_target_blocks]])
    move_slots(
        pool,
        tables,
        target.view(len(layers), num_target_blocks),
        kept.view(len(layers), num_kv_heads, -1),
    )


def _stacked_keys(pool: torch.Tensor, tables: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``[layers * num_kv_heads, num_slots, head_dim]`` keys of the pages ``tables``
    ``[layers, num_blocks]`` (a copy)."""
    num_layers, num_blocks = tables.shape
    _, _, num_kv_heads, block_size, head_dim = pool.shape
    pages = pool[:, 0].index_select(0, tables.flatten())  # [L * blocks, KVH, block, d]
    pages = pages.view(num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    keys = pages.transpose(1, 2).reshape(num_layers * num_kv_heads, -1, head_dim)
    return keys[:, :num_slots]


def move_slots(
    pool: torch.Tensor, source: torch.Tensor, target: torch.Tensor, kept: torch.Tensor
) -> None:
    """Move the kept slots of each (layer, KV head) to slots ``0 .. k - 1`` of its target pages.

    Args:
        pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` page tensor (written).
        source: ``[layers, >= num_blocks]`` int64 pages holding the slots ``kept`` indexes.
        target: ``[layers, ceil(k / block_size)]`` int64 pages to write (``source``'s own in
            place: every kept slot is read before any is written). Slots past ``k`` in the
            last target page are overwritten with copies (they are not held).
        kept: ``[layers, num_kv_heads, k]`` int64 slot indices; slot ``j`` of the result is
            ``kept[..., j]``.
    """
    _, _, num_kv_heads, block_size, head_dim = pool.shape
    num_layers, _, k = kept.shape
    num_target_blocks = target.shape[1]
    # Source slot of every target slot, padded to whole pages with the last kept slot.
    padded = torch.cat(
        [kept, kept[..., -1:].expand(-1, -1, num_target_blocks * block_size - k)], -1
    )
    page = source.gather(1, (padded // block_size).flatten(1)).view_as(padded)
    # Rows of pool.view(-1, head_dim): ((page * 2 + half) * KVH + head) * block + offset.
    heads = torch.arange(num_kv_heads, device=pool.device)[None, :, None]
    rows = (page * 2 * num_kv_heads + heads) * block_size + padded % block_size
    # Ordered as the target pages are laid out: [L, blocks, half, KVH, block].
    rows = rows.view(num_layers, num_kv_heads, num_target_blocks, block_size).permute(0, 2, 1, 3)
    rows = torch.stack([rows, rows + num_kv_heads * block_size], dim=2)
    data = pool.view(-1, head_dim).index_select(0, rows.flatten())
    pool.index_copy_(0, target.flatten(), data.view(-1, 2, num_kv_heads, block_size, head_dim))
