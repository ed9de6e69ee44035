"""Compression inside a step: the prefill-time compression and the decode-time compactions.

Both run on the step's ``PagedAttention`` (its storages, backend, soft-cap and RoPE
frequencies):

- ``compress`` scores one layer of a request with the observation window and writes only the
  kept K/V into its pages; the general path calls it for a layer that compresses in the step
  (``prompt``: the prefill compression, which may rank by shared scores,
  ``runner.layer_scores``);
- ``compact_pending`` runs the decode-time compactions after the forward
  (``PagedAttention.finish``): a request's compacting layers with equal slot counts, budgets,
  scales and storage go together, from the pages in place where ``runner.compaction`` applies,
  else gathered and stacked into one view (``compact_decode_stacked``), else one layer at a
  time (``compact_decode``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparsekv.compression.base import LayerView, ReconstructionRows
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.runner import compaction, headwise
from sparsekv.runner.layer_scores import shared_scores
from sparsekv.runner.metadata import RequestSlice

if TYPE_CHECKING:
    from sparsekv.runner.paged_attention import PagedAttention


def compact_pending(
    attention: PagedAttention, pending: list[tuple[RequestSlice, int, float]]
) -> None:
    """Run the step's decode-time compactions.

    Args:
        attention: the step's ``PagedAttention``.
        pending: the (request, layer, softmax scale) compactions the decode path queued (or
            ``record_decode_step`` adopted), in order; each request's layers are grouped by
            slot count, budget, scale and storage, one compaction per group.
    """
    by_request: dict[int, list[tuple[RequestSlice, int, float]]] = {}
    for item in pending:
        by_request.setdefault(id(item[0]), []).append(item)
    for items in by_request.values():
        request = items[0][0]
        groups: dict[tuple, list[int]] = {}
        for _, layer, scale in items:
            step = request.layers[layer]
            key = (step.num_held, step.compress_to, scale, id(attention.storages[layer]))
            groups.setdefault(key, []).append(layer)
        for (_, _, scale, _), layers in groups.items():
            if compaction.applies(
                request, layers, attention.storages, attention.backend, attention.logit_softcap
            ):
                compaction.compact_from_pages(
                    request, layers, attention.storages, scale, attention.backend
                )
            elif request.compressor.stackable:
                compact_decode_stacked(attention, request, layers, scale)
            else:
                for layer in layers:
                    compact_decode(attention, request, layer, scale)


def compact_decode(
    attention: PagedAttention, request: RequestSlice, layer: int, scale: float
) -> None:
    """Decode-time eviction after the decode path wrote and attended the new token.

    The layer's ``num_held + 1`` slots are gathered from the pages once and re-scored with
    the stored window queries (the compressor computes their log-sum-exps over exactly
    the slots each row sees: ``w x n`` logits, no attention re-run over a gathered copy);
    the kept K/V go to the first slots of the layer's table (or its copy-on-write table).
    """
    step = request.layers[layer]
    state = request.kv.layers[layer]
    keys, values = attention.storages[layer].gather(state, step.block_table, step.num_held + 1)
    target = step.compact_table if step.compact_table is not None else step.block_table
    compress(attention, request, layer, state, target, keys, values, None, scale)


def compact_decode_stacked(
    attention: PagedAttention, request: RequestSlice, layers: list[int], scale: float
) -> None:
    """``compact_decode`` of several layers with equal slot counts and budgets at once:
    their heads are stacked into one ``LayerView`` (layer-major, so every query head stays
    in its KV head's group) and one ``select`` picks every layer's kept slots."""
    states = [request.kv.layers[layer] for layer in layers]
    num_slots = request.layers[layers[0]].num_held + 1
    gathered = [
        attention.storages[layer].gather(state, request.layers[layer].block_table, num_slots)
        for layer, state in zip(layers, states)
    ]
    keys = torch.cat([k for k, _ in gathered])
    values = torch.cat([v for _, v in gathered])
    accumulated = None
    if states[0].accumulated is not None:
        accumulated = torch.cat([state.accumulated for state in states])
    view = _view(
        attention,
        request,
        keys,
        values,
        scale,
        window_queries=torch.cat([state.recent_queries for state in states]),
        window_lse=None,
        accumulated=accumulated,
    )
    budget = request.layers[layers[0]].compress_to
    kept = request.compressor.select(view, budget, request.window)  # [L * KVH, k]
    num_kv_heads = gathered[0][0].shape[0]
    for i, (layer, state) in enumerate(zip(layers, states)):
        rows = slice(i * num_kv_heads, (i + 1) * num_kv_heads)
        step = request.layers[layer]
        target = step.compact_table if step.compact_table is not None else step.block_table
        attention.storages[layer].write_kept(state, target, keys[rows], values[rows], kept[rows])
        if state.accumulated is not None:
            state.accumulated = state.accumulated.gather(1, kept[rows])


def compress(
    attention: PagedAttention,
    request: RequestSlice,
    layer: int,
    state: LayerKV,
    table: list[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    reconstruction: tuple[ReconstructionRows, ...] = (),
    prompt: bool = False,
) -> None:
    """Score and compact one layer of ``request`` to its step's budget (``compress_to``).

    Args:
        attention: the step's ``PagedAttention``.
        request, layer: the request's slice of the step and the layer index.
        state: the request's layer state (window queries, H2O accumulator).
        table: the block table the kept slots are written to (the layer's, or its
            copy-on-write table).
        keys, values: ``[num_kv_heads, n, head_dim]`` every slot the layer holds, in the
            storage dtype.
        lse: ``[num_heads, m]`` fp32 log-sum-exps of the chunk's rows, or ``None``.
        scale: softmax scale.
        reconstruction: KVzip's reconstruction rows of the layer.
        prompt: the prefill compression, where the policy may rank by the first layer's
            scores (``runner.layer_scores``).

    Raises:
        RuntimeError: a reconstructing layer would score without its reconstruction rows
            (a planning bug).
    """
    window_queries = state.recent_queries
    num_window = window_queries.shape[1]
    # The chunk's own LSE serves when the whole window lies in this chunk.
    window_lse = None
    if lse is not None and lse.shape[1] >= num_window:
        window_lse = lse[:, -num_window:]
    view = _view(
        attention,
        request,
        keys,
        values,
        scale,
        window_queries=window_queries,
        window_lse=window_lse,
        accumulated=state.accumulated,
        rope_inv_freq=(
            None if attention.rope_frequencies is None else attention.rope_frequencies[layer]
        ),
        reconstruction=reconstruction,
    )
    step = request.layers[layer]
    scores = shared_scores(request, view, step.compress_to) if prompt else None
    if prompt and scores is None and request.compressor.reconstructs and not reconstruction:
        if view.num_tokens > step.compress_to:  # the rows left too early: a planning bug
            raise RuntimeError(f"layer {layer} scores without its reconstruction rows")
    if step.to_heads:
        kept_heads = request.compressor.select_heads(view, step.compress_to, request.window, scores)
        headwise.write_heads(attention.storages[layer], state, table, keys, values, kept_heads)
        return
    kept = request.compressor.select(view, step.compress_to, request.window, scores)
    attention.storages[layer].write_kept(state, table, keys, values, kept)
    if state.accumulated is not None:
        state.accumulated = state.accumulated.gather(1, kept)


def _view(
    attention: PagedAttention,
    request: RequestSlice,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    **fields,
) -> LayerView:
    """A ``LayerView`` of ``keys`` / ``values`` (``[num_kv_heads, n, head_dim]``) with the
    step's soft-cap and backend and the request's generator; ``fields``: the rest."""
    return LayerView(
        keys=keys,
        values=values,
        scale=scale,
        generator=request.generator,
        logit_softcap=attention.logit_softcap,
        backend=attention.backend,
        **fields,
    )
