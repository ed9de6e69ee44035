"""Scores shared across the layers that compress a prompt (``layer_scores = "first"``).

With ``--kv-layer-scores first`` the first budgeted layer that compresses a request's slots in a
forward scores them, and every later budgeted layer that compresses the same number of slots in
that forward ranks its slots by those scores instead of its own, so all of them keep the same
tokens (each under its own budget). An early layer's attention picks the tokens for the whole
model, as in GemFilter (Shi et al., arXiv 2409.17422); on Gemma 3 270M the first global layer's
KVzip scores find a needle that the later global layers' own scores miss
(docs/compression.md, "Scores from the first layer").

It applies where a prompt is compressed (the prefill step). Decode-time eviction ranks each
layer by its own stored window queries. A reconstructing method (KVzip) then needs its
reconstruction rows only up to the last layer that scores its own (the first one, unless a later
layer holds another count of slots): ``last_reconstruction_layer`` says where they can leave
the forward.
"""

from __future__ import annotations

import torch

from sparsekv.compression.base import Compressor, LayerView
from sparsekv.kv_cache.plan import LayerStep
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


def last_reconstruction_layer(compressor: Compressor, layers: list[LayerStep]) -> int | None:
    """The last layer of a prefill step whose compression scores with the reconstruction
    rows, or ``None`` when no layer does.

    A layer scores when it compresses its prompt slots (``compress_to`` set, not a decode-time
    compaction) and holds more than its budget: ``num_held + num_new`` slots, the ``n`` of its
    view. With ``layer_scores="first"`` only the first such layer and the later ones holding
    another count of slots score (``shared_scores``); the others rank by the first layer's
    scores and read no rows.
    """
    last, shared = None, None
    for index, step in enumerate(layers):
        if step.compress_to is None or step.decode_compaction:
            continue
        num_slots = step.num_held + step.num_new
        if num_slots <= step.compress_to:
            continue
        if compressor.layer_scores == "first":
            if shared is None:
                shared = num_slots
            elif num_slots == shared:
                continue
        last = index
    return last
