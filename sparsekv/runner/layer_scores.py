"""Scores shared across the layers that compress a prompt (``layer_scores = "first"``).

With ``--kv-layer-scores first`` the first budgeted layer that compresses a request's slots in a
forward scores them, and every later budgeted layer that compresses the same number of slots in
that forward ranks its slots by those scores instead of its own, so all of them keep the same
tokens (each under its own budget). An early layer's attention picks the tokens for the whole
model, as in GemFilter (Shi et al., arXiv 2409.17422); on Gemma 3 270M the first global layer's
KVzip scores find a needle that the later global layers' own scores miss
(docs/compression.md, "Scores from the first layer").

It applies where a prompt is compressed (the prefill step). Decode-time eviction ranks each
layer by its own stored window queries.
"""

from __future__ import annotations

import torch

from sparsekv.compression.base import LayerView
from sparsekv.runner.metadata import RequestSlice


def shared_scores(request: RequestSlice, view: LayerView, budget: int) -> torch.Tensor | None:
    """The scores this layer of ``request`` ranks by, or ``None`` to score its own.

    The first call of a forward that compresses (``n > budget``) computes the layer's scores
    with ``Compressor.ranking_scores`` and keeps them on the request's slice; later calls with
    the same ``[num_kv_heads, n]`` shape return them. A layer holding a different number of
    slots (an earlier chunk compressed it differently) scores its own.

    Returns:
        ``[num_kv_heads, n]`` fp32, never modified by the caller, or ``None`` when the policy
        scores per layer or this layer keeps every slot.
    """
    compressor = request.compressor
    if compressor is None or compressor.layer_scores != "first" or view.num_tokens <= budget:
        return None
    kept = request.first_layer_scores
    if kept is not None and kept.shape == (view.num_kv_heads, view.num_tokens):
        return kept
    if kept is not None:
        return None
    request.first_layer_scores = compressor.ranking_scores(view)
    return request.first_layer_scores
