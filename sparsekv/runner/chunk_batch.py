"""Several requests' chunks of one layer read from their pages in one backend call.

A step with several verifying requests (speculative decoding: K + 1 rows each) or several
prefill chunks puts each of them on the general path; those whose chunk reads its earlier keys
from the pages in place (``general_attention.chunk_from_pages``) need nothing but attention over
held slots plus themselves, so they are handed together as a ragged batch to the backend's
``prefill_attention_paged_batch`` (``CpuNativeBackend``: one native call per layer instead of
one per request). The rest, and every request where the backend has no batched route
(``batches_paged_chunks`` False) or declines the tensors, stay on the per-request path.

The call's index tensors (:class:`ChunkPlan`: rows, block tables, slot counts, the slots the
new keys go to) are built in a few NumPy passes over all the chosen requests, and the new keys
and values are written with one scatter: a layer costs a fixed handful of tensor operations
however many requests it batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparsekv.runner.block_tables import padded_tables
from sparsekv.runner.general_attention import chunk_from_pages
from sparsekv.runner.metadata import RequestSlice


@dataclass
class ChunkPlan:
    """One layer's batched chunk call over ``B`` requests with ``R`` new rows in all.

    Attributes:
        rows: ``[R]`` int64 rows of the requests' new tokens in the step's flattened batch,
            request after request.
        tables: ``[B, max_blocks]`` int64 block tables as local page indices of the layer's
            storage (padding 0), covering the held slots and the new ones.
        row_starts: ``[B + 1]`` int64 first row of each request in ``rows``.
        held: ``[B]`` int64 held slots before the step.
        slots: ``[R]`` int64 global physical slots (``page * block_size + offset``) where the
            new rows' keys and values go.
    """

    rows: torch.Tensor
    tables: torch.Tensor
    row_starts: torch.Tensor
    held: torch.Tensor
    slots: torch.Tensor


def chunk_plan(
    chosen: list[RequestSlice], layer: int, block_size: int, page_offset: int
) -> ChunkPlan:
    """The index tensors of ``chosen``'s chunks at ``layer`` (CPU tensors; ``page_offset``:
    the storage's first global page, subtracted for its local indices).

    Raises:
        ValueError: ``chosen`` is empty, or a request's block table lacks a page its new rows
            go to.
    """
    if not chosen:
        raise ValueError("chosen: no requests to plan")
    steps = [r.layers[layer] for r in chosen]
    count = len(chosen)
    held = np.fromiter((s.num_held for s in steps), dtype=np.int64, count=count)
    num_rows = np.fromiter((r.num_rows for r in chosen), dtype=np.int64, count=count)
    starts = np.fromiter((r.start for r in chosen), dtype=np.int64, count=count)
    pages_needed = (-(-(held + num_rows) // block_size)).tolist()
    page_lists = [s.block_table[:n] for s, n in zip(steps, pages_needed)]
    if any(len(pages) < n for pages, n in zip(page_lists, pages_needed)):
        # the padding would send those rows to page 0 of another storage
        raise ValueError("block_table: a chunk's new rows fall past the pages allocated to it")
    tables = padded_tables(page_lists)
    row_starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(num_rows, out=row_starts[1:])
    owner = np.repeat(np.arange(count), num_rows)  # request of each new row
    within = np.arange(int(row_starts[-1])) - row_starts[owner]  # row index in its chunk
    offsets = held[owner] + within  # held-slot index each new row is written to
    slots = tables[owner, offsets // block_size] * block_size + offsets % block_size
    local = tables - page_offset if page_offset else tables
    np.maximum(local, 0, out=local)  # padding may belong to another storage: any id serves
    return ChunkPlan(
        rows=torch.from_numpy(starts[owner] + within),
        tables=torch.from_numpy(local),
        row_starts=torch.from_numpy(row_starts),
        held=torch.from_numpy(held),
        slots=torch.from_numpy(slots),
    )


def attend_chunk_batch(
    attention,
    requests: list[RequestSlice],
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> list[RequestSlice]:
    """Attend the chunks of ``requests`` that read from the pages in one batched call.

    Args:
        attention: the step's ``PagedAttention``.
        requests: the layer's general-path requests.
        layer: layer index.
        q: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads,
            head_dim]`` (the step's rows).
        scale: softmax scale; window: the layer's sliding window or ``None``.
        out: ``[num_tokens, num_heads, head_dim]``: the batched requests' rows are written.

    Returns:
        The requests left for the per-request path (all of them when nothing was batched).
    """
    if not attention.backend.batches_paged_chunks:
        return requests
    storage = attention.storages[layer]
    chosen = [
        r for r in requests if chunk_from_pages(r, r.layers[layer], r.kv.layers[layer], storage)
    ]
    if len(chosen) < 2:
        return requests
    plan = chunk_plan(chosen, layer, storage.block_size, storage.page_offset)
    device = q.device
    rows = plan.rows.to(device)
    new_k, new_v = k[rows], v[rows]  # [R, num_kv_heads, head_dim]
    result = attention.backend.prefill_attention_paged_batch(
        q[rows].transpose(0, 1), new_k.transpose(0, 1).to(storage.dtype),
        new_v.transpose(0, 1).to(storage.dtype), storage.tensors[0], plan.tables.to(device),
        plan.row_starts.to(device), plan.held.to(device), scale, window,
        attention.logit_softcap,
    )  # fmt: skip
    if result is None:
        return requests
    out[rows] = result[0].transpose(0, 1)
    for request in chosen:
        state = request.kv.layers[layer]
        if state.budget is not None:
            state.remember_queries(q[request.start : request.start + request.num_rows],
                                   request.window)  # fmt: skip
    storage.write_rows(plan.slots.to(device), new_k, new_v)
    return [r for r in requests if all(r is not c for c in chosen)]
