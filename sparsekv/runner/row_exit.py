"""Rows that leave a step's forward early: reconstruction rows no later layer reads.

A KVzip request's reconstruction rows (``RequestSlice.segments``) exist only to be scored; no
token is sampled from them and their K/V are never cached. Once the forward has passed the last
layer that scores with them (``RequestSlice.reconstruction_until``), the rest of the model
would spend attention and MLP on rows whose outputs nobody reads. With per-layer scores that
is the last compressing layer (no saving); with ``layer_scores="first"`` it is the first one,
so on Gemma 3 270M (global layers 5, 11, 17) the rows stop after layer 5 of 18.
"""

from __future__ import annotations

import torch

from sparsekv.runner.metadata import RequestSlice


def drop_finished_rows(slices: list[RequestSlice], layer: int) -> torch.Tensor | None:
    """After ``layer``: the batch rows the forward keeps, when some request's reconstruction
    rows are done with.

    The requests whose ``reconstruction_until`` is ``layer`` lose their ``segments``, and every
    request's ``start`` moves to its row in the kept batch (so what reads ``start`` after the
    forward, sampling and prompt logprobs, reads the kept rows). The caller indexes every
    per-row tensor with the result and rebuilds the step's metadata.

    Args:
        slices: the step's requests in batch order (changed in place).
        layer: the layer the forward has just run.

    Returns:
        ``[kept_rows]`` int64 row indices into the current batch, in order, or ``None`` when no
        request's rows end here (nothing changes).
    """
    if not any(s.segments and s.reconstruction_until == layer for s in slices):
        return None
    kept: list[torch.Tensor] = []
    start = 0
    for request in slices:
        rows = request.num_rows
        if request.segments and request.reconstruction_until == layer:
            request.segments = ()
            request.reconstruction_until = None
            rows = request.num_new
        kept.append(torch.arange(request.start, request.start + rows))
        request.start = start
        start += rows
    return torch.cat(kept)
