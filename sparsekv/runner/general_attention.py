"""The general path of ``PagedAttention``: one request's rows of one layer at a time.

Prefill chunks, steps that compress and layers with head-wise pages (``runner.headwise``) take
this path. Earlier K/V are gathered from the pages (or, for a chunk that keeps every slot over
full-precision pages, read in place), the new K/V appended as activations, attention returns
each row's log-sum-exp, and a compressing layer scores the slots with the observation window
(reusing that LSE) and writes only the kept K/V into its pages (``step_compression.compress``);
a layer whose pages are shared compacts into the fresh pages of ``LayerStep.compact_table``.
A request's KVzip reconstruction rows attend here over the layer's uncompressed slots and their
own segment; their K/V are handed to the compressor and never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparsekv.compression.base import ReconstructionRows
from sparsekv.compression.scoring import prefill_attention_mass
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.storage import KVStorage
from sparsekv.runner import headwise, step_compression
from sparsekv.runner.attention_mass import accumulate_mass, row_masses
from sparsekv.runner.metadata import RequestSlice

if TYPE_CHECKING:
    from sparsekv.runner.paged_attention import PagedAttention


def attend_general(
    attention: PagedAttention,
    request: RequestSlice,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of one request's rows of one layer over its cache, with the layer's cache
    writes and, where the step compresses the layer, its compression.

    Args:
        attention: the step's ``PagedAttention`` (storages, backend, soft-cap).
        request: the request's slice of the step.
        layer: layer index.
        q: ``[rows, num_heads, head_dim]`` post-RoPE queries of the request's rows: its
            ``num_new`` new tokens, then any reconstruction rows (``request.segments``).
        k, v: ``[rows, num_kv_heads, head_dim]`` the rows' new keys (post-RoPE) and values.
        scale: softmax scale.
        window: the layer's attention window in tokens, or ``None``.

    Returns:
        ``[rows, num_heads, head_dim]``.
    """
    step = request.layers[layer]
    state = request.kv.layers[layer]
    storage = attention.storages[layer]
    softcap = attention.logit_softcap
    if step.head_lens is not None:
        return headwise.chunk_heads(storage, step, state, q, k, v, scale, window, softcap)
    held = step.num_held
    if chunk_from_pages(request, step, state, storage):
        # A chunk after earlier ones that keeps every slot: the earlier keys are read from
        # the pages in place, no gathered copy.
        new_k, new_v = (t.transpose(0, 1).to(storage.dtype) for t in (k, v))
        out, _ = storage.chunk_attention(
            step.block_table, held, q.transpose(0, 1), new_k, new_v, scale, window, softcap
        )
        if state.budget is not None:
            state.remember_queries(q, request.window)
        storage.write_slots(state, step.block_table, held, new_k, new_v)
        return out.transpose(0, 1)
    num_new = request.num_new
    cached_k, cached_v = storage.gather(state, step.block_table, held)
    keys = torch.cat([cached_k, k[:num_new].transpose(0, 1).to(storage.dtype)], dim=1)
    values = torch.cat([cached_v, v[:num_new].transpose(0, 1).to(storage.dtype)], dim=1)
    queries = q[:num_new].transpose(0, 1)  # [H, n, d]
    out, lse = attention.backend.prefill_attention(
        queries, keys, values, scale, sliding_window=window, logit_softcap=softcap
    )
    out = out.transpose(0, 1)
    reconstruction: tuple[ReconstructionRows, ...] = ()
    if request.segments:
        rows = slice(num_new, None)
        recon_out, reconstruction = _reconstruct(
            attention, request.segments, q[rows], k[rows], v[rows], keys, values, scale, window
        )
        out = torch.cat([out, recon_out])
        if step.compress_to is None:
            reconstruction = ()
    if state.budget is not None:
        state.remember_queries(q[:num_new], request.window)
    if request.needs_attention_mass and state.budget is not None:
        accumulate_mass(state, prefill_attention_mass(keys, queries, lse, scale, softcap))
        if request.draft_mass is not None:
            request.draft_mass[layer] = row_masses(keys, queries, lse, scale, softcap)
    if step.compress_to is None or step.keep_uncompressed:
        storage.write_slots(state, step.block_table, held, keys[:, held:], values[:, held:])
    if step.compress_to is not None:
        # Shared pages are never written: a compaction then goes to fresh pages.
        target = step.compact_table if step.compact_table is not None else step.block_table
        step_compression.compress(
            attention, request, layer, state, target, keys, values, lse, scale, reconstruction, True
        )
    return out


def chunk_from_pages(request: RequestSlice, step, state: LayerKV, storage: KVStorage) -> bool:
    """True when a general-path chunk needs no dense copy of its keys: earlier slots are
    held, the layer neither compresses nor accumulates attention mass this step, the step
    carries no reconstruction rows (KVzip), and the pages hold full precision."""
    return (
        step.num_held > 0
        and step.head_lens is None
        and not request.segments
        and step.compress_to is None
        and not (request.needs_attention_mass and state.budget is not None)
        and storage.reads_chunks_in_place()
    )


def _reconstruct(
    attention: PagedAttention,
    segments: tuple[int, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, tuple[ReconstructionRows, ...]]:
    """Attention of the reconstruction rows (KVzip): each segment's rows ``q``/``k``/``v``
    ``[m, heads, d]`` (the segments one after another) attend over the layer's held and
    new ``keys``/``values`` ``[num_kv_heads, n, d]`` and their own segment, causally.
    Returns their outputs ``[rows, num_heads, d]`` and each segment's rows for scoring;
    their K/V go nowhere else."""
    outs, rows = [], []
    start = 0
    for length in segments:
        part = slice(start, start + length)
        start += length
        seg_q = q[part].transpose(0, 1)
        seg_k = k[part].transpose(0, 1).to(keys.dtype)
        seg_v = v[part].transpose(0, 1).to(values.dtype)
        out, lse = attention.backend.prefill_attention(
            seg_q,
            torch.cat([keys, seg_k], dim=1),
            torch.cat([values, seg_v], dim=1),
            scale,
            sliding_window=window,
            logit_softcap=attention.logit_softcap,
        )
        outs.append(out.transpose(0, 1))
        rows.append(ReconstructionRows(seg_q, seg_k, lse))
    return torch.cat(outs), tuple(rows)
