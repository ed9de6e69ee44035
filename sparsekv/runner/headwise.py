"""Attention and compaction over head-wise pages (adaptive head budgets).

A layer compressed with adaptive head budgets keeps a different slot count per KV head
(``kv_cache.head_pages``). Its pages are read through the storage's one-head view
(``KVStorage.head_view``): each KV head is an item of one head with its own table and length,
attended by the query heads of its group. Such a layer takes the general path every step:

- one new token (decode): its K/V go to the next slot of every head, and one paged decode call
  per layer attends the ``num_kv_heads`` items of every such request of the step, each over its
  own length (``decode_heads``);
- several new tokens (a question after a compressed context): each head attends its held
  slots from the pages plus the new rows (``KVStorage.chunk_attention``), then the rows are
  appended to every head.
"""

from __future__ import annotations

import torch

from sparsekv.attention.backends.base import DecodeParams
from sparsekv.kv_cache import head_pages
from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.storage import KVStorage
from sparsekv.runner.block_tables import padded_tables


def decode_heads(
    storage: KVStorage,
    steps: list[LayerStep],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """One new token of each of several requests over their head-wise layer: every token's
    K/V go to the next slot of each of its KV heads, then one paged decode call attends the
    ``len(steps) * num_kv_heads`` items, each over its own head's length.

    Args:
        storage: the layer's page storage (full precision).
        steps: each request's plan of the layer (``head_lens`` / ``head_pages`` before the
            step, pages allocated for the new token).
        q: ``[batch, num_heads, head_dim]`` post-RoPE queries, one row per step; k, v:
            ``[batch, num_kv_heads, head_dim]``.
        scale: softmax scale; window: the layer's attention window in slots (as the flat
            decode path reads it) or ``None``; logit_softcap: the model's soft-cap or ``None``.

    Returns:
        ``[batch, num_heads, head_dim]`` in the query dtype.
    """
    view = storage.head_view()
    batch, num_heads, head_dim = q.shape
    num_kv_heads = storage.num_kv_heads
    per_page = view.block_size
    tables: list[list[int]] = []
    lens: list[int] = []
    for step in steps:
        tables += head_pages.head_tables(step.block_table, list(step.head_pages))
        lens += step.head_lens
    slots = [table[n // per_page] * per_page + n % per_page for table, n in zip(tables, lens)]
    items = batch * num_kv_heads
    view.write_decode(
        torch.tensor(slots, dtype=torch.long, device=q.device),
        [],
        k.reshape(items, 1, head_dim),
        v.reshape(items, 1, head_dim),
    )
    params = DecodeParams(
        block_tables=torch.from_numpy(padded_tables(tables)).to(q.device),
        seq_lens=torch.tensor(lens, dtype=torch.long, device=q.device) + 1,
        scale=scale,
        sliding_window=window,
        logit_softcap=logit_softcap,
    )
    query = q.reshape(items, num_heads // num_kv_heads, head_dim)
    out, _, _ = view.decode_attention(query, params, [])
    return out.reshape(batch, num_heads, head_dim)


def chunk_heads(
    storage: KVStorage,
    step: LayerStep,
    state: LayerKV,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """Several new rows of one request over a head-wise layer (one-token rows go to
    ``decode_heads``): each KV head attends its held slots from the pages plus the rows
    (``KVStorage.chunk_attention``), then the rows are appended to that head.

    Args:
        storage: the layer's page storage (full precision).
        step: the layer's plan (``head_lens`` / ``head_pages`` before the step, pages
            allocated for the new rows).
        state: the layer's state (passed to the storage's writes).
        q: ``[m, num_heads, head_dim]`` post-RoPE queries; k, v: ``[m, num_kv_heads,
            head_dim]`` new keys and values.
        scale, window, logit_softcap: as for ``decode_heads``.

    Returns:
        ``[m, num_heads, head_dim]`` in the query dtype.
    """
    view = storage.head_view()
    group = q.shape[1] // storage.num_kv_heads
    tables = head_pages.head_tables(step.block_table, list(step.head_pages))
    out = torch.empty_like(q)
    for head, (table, n) in enumerate(zip(tables, step.head_lens)):
        heads = slice(head * group, (head + 1) * group)
        new_k = k[:, head : head + 1].transpose(0, 1).to(view.dtype)
        new_v = v[:, head : head + 1].transpose(0, 1).to(view.dtype)
        result, _ = view.chunk_attention(
            table, n, q[:, heads].transpose(0, 1), new_k, new_v, scale, window, logit_softcap
        )
        out[:, heads] = result.transpose(0, 1)
        view.write_slots(state, table, n, new_k, new_v)
    return out


def write_heads(
    storage: KVStorage,
    state: LayerKV,
    table: list[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: list[torch.Tensor],
) -> None:
    """Compact a layer into head-wise pages: head ``h``'s rows ``kept[h]`` go to its slots
    ``0 .. len(kept[h]) - 1``, heads taking consecutive runs of ``table``; the split is
    recorded in ``state`` (``head_lens``, ``head_pages``) for the commit.

    Args:
        storage: the layer's page storage (full precision).
        table: the pages the compaction writes (the layer's table or its fresh
            ``compact_table``), at least ``sum_h ceil(len(kept[h]) / slots_per_page)``.
        keys, values: ``[num_kv_heads, n, head_dim]`` the layer's slots before compaction.
        kept: per KV head, ascending int64 row indices into ``n``.
    """
    view = storage.head_view()
    lens = [int(rows.numel()) for rows in kept]
    counts = head_pages.split_pages(lens, view.block_size)
    assert sum(counts) <= len(table), (counts, len(table))
    start = 0
    for head, (rows, count) in enumerate(zip(kept, counts)):
        pages = table[start : start + count]
        start += count
        view.write_leading(state, pages, keys[head : head + 1, rows], values[head : head + 1, rows])
    state.head_lens, state.head_pages = lens, counts
