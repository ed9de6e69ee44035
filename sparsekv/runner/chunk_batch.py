"""Several requests' chunks of one layer read from their pages in one backend call.

A step with several verifying requests (speculative decoding: K + 1 rows each) or several
prefill chunks puts each of them on the general path; those whose chunk reads its earlier keys
from the pages in place (``PagedAttention._chunk_from_pages``) need nothing but attention over
held slots plus themselves, so they are handed together as a ragged batch to the backend's
``prefill_attention_paged_batch`` (``CpuNativeBackend``: one native call per layer instead of
one per request). The rest, and every request where the backend has no batched route
(``batches_paged_chunks`` False) or declines the tensors, stay on the per-request path.
"""

from __future__ import annotations

import torch

from sparsekv.runner.metadata import RequestSlice


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
        r
        for r in requests
        if attention._chunk_from_pages(r, r.layers[layer], r.kv.layers[layer], storage)
    ]
    if len(chosen) < 2:
        return requests
    rows = torch.cat([torch.arange(r.start, r.start + r.num_rows) for r in chosen]).to(q.device)
    new_k, new_v = (t[rows].transpose(0, 1).to(storage.dtype) for t in (k, v))
    held = [r.layers[layer].num_held for r in chosen]
    pages = [storage.local(r.layers[layer].block_table[: -(-n // storage.block_size)])
             for r, n in zip(chosen, held)]  # fmt: skip
    tables = torch.zeros(len(chosen), max(len(p) for p in pages), dtype=torch.long)
    for i, p in enumerate(pages):
        tables[i, : len(p)] = p
    lengths = torch.tensor([0] + [r.num_rows for r in chosen])
    result = attention.backend.prefill_attention_paged_batch(
        q[rows].transpose(0, 1), new_k, new_v, storage.tensors[0], tables.to(q.device),
        lengths.cumsum(0).to(q.device), torch.tensor(held, device=q.device), scale, window,
        attention.logit_softcap,
    )  # fmt: skip
    if result is None:
        return requests
    out[rows] = result[0].transpose(0, 1)
    start = 0
    for request, n in zip(chosen, held):
        part = slice(start, start + request.num_rows)
        start += request.num_rows
        state, step = request.kv.layers[layer], request.layers[layer]
        if state.budget is not None:
            state.remember_queries(q[request.start : request.start + request.num_rows],
                                   request.window)  # fmt: skip
        storage.write_slots(state, step.block_table, n, new_k[:, part], new_v[:, part])
    return [r for r in requests if all(r is not c for c in chosen)]
