"""Bytes a speculative step reads, against a read bandwidth (``sparsekv bench spec-decode``).

A decode step is bound by reading the weights and every held K/V slot once (the rows of a
verification chunk share those reads). Per emitted token of one request, at ``C`` held slots
per layer, ``B`` requests per step, ``K`` drafts and a mean accepted length ``L`` (tokens per
verification, the bonus token included):

* plain: ``(W + B * C * s) / B``;
* sparse self-speculation: ``(K * (W + B * V * s) + W + B * C * s) / (B * L)``: ``K`` draft
  forwards reading the weights and each request's view of ``V = min(C, view)`` slots, then one
  verification reading the whole cache;

with ``W`` the bytes of the weights a step reads (every linear and the LM head; the embedding
is gathered, a few rows) and ``s`` the K/V bytes of one slot summed over layers. A draft with a
reduced vocabulary (``draft_vocab_size``) reads only that share of the LM head: its ``W`` is
smaller (:func:`draft_weight_bytes`). The bound is
``bandwidth / bytes`` tokens per second and request. Compression off; every layer full.
"""

from __future__ import annotations

import torch

from sparsekv.bench.kernels.probe import best_time
from sparsekv.models.head_rows import reads_leading_rows


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers a decode step reads (packed weights counted as
    stored), the embedding table left out unless it is also the LM head."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.named_parameters(), *model.named_buffers()]
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    for name, tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if name.startswith("embed_tokens") and tensor is not head:
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def draft_weight_bytes(
    model: torch.nn.Module, weights: int, draft_vocab: int | None, rows: int
) -> int:
    """Bytes a draft forward of ``rows`` rows reads of the weights: ``weights``
    (:func:`weight_bytes`) less the LM head rows at or past ``draft_vocab`` where the head reads
    its leading rows alone (``head_rows.reads_leading_rows``; ``None``: the whole head)."""
    head = getattr(model, "lm_head", None)
    vocab = getattr(head, "out_features", None)
    if draft_vocab is None or head is None or not vocab or draft_vocab >= vocab:
        return weights
    if not reads_leading_rows(head, rows):
        return weights
    head_bytes = sum(t.numel() * t.element_size() for t in (*head.parameters(), *head.buffers()))
    return weights - round(head_bytes * (1 - draft_vocab / vocab))


def slot_bytes(engine) -> int:
    """K/V bytes of one slot summed over the layers (scales of quantized pages included)."""
    kv = engine.kv
    return sum(kv.storage(layer).page_bytes for layer in range(kv.num_layers)) // kv.block_size


def view_slots(context: int, block_size: int, sink_tokens: int, recent_tokens: int) -> int:
    """Slots a ``sparse_self`` draft view holds at ``context`` held slots (about: the pages of
    the sink and of the recent slots, ``spec_decode.sparse_view.view_table``)."""
    sink = -(-sink_tokens // block_size) * block_size
    recent = recent_tokens + block_size
    return min(context, sink + recent)


def measure_bandwidth(repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best fp32 sum of 512 MiB (``bench kernels``' probe)."""
    data = torch.ones(128 * 1024 * 1024)
    return data.numel() * 4 / best_time(data.sum, repeats)


def step_figures(
    weights: int,
    per_slot: int,
    context: int,
    batch: int,
    num_drafts: int,
    view: int,
    accepted_length: float | None,
    bandwidth: float,
    draft_weights: int | None = None,
) -> dict:
    """Bytes per step and per emitted token, and the bandwidth bound (module docstring).

    ``draft_weights`` is the weight bytes a draft forward reads (default ``weights``).

    Returns:
        ``target_step_mb`` (a plain or verification step), ``draft_step_mb`` (one draft
        forward), ``plain_bytes_per_token_mb``, ``self_bytes_per_token_mb`` and the bounds
        ``plain_bound_tok_s`` / ``self_bound_tok_s`` (all requests together); the
        ``self_*`` figures are ``None`` without an accepted length.
    """
    target = weights + batch * context * per_slot
    draft = (weights if draft_weights is None else draft_weights) + batch * view * per_slot
    figures = {
        "context_slots": context,
        "view_slots": view,
        "target_step_mb": target / 1e6,
        "draft_step_mb": draft / 1e6,
        "plain_bytes_per_token_mb": target / batch / 1e6,
        "plain_bound_tok_s": bandwidth * batch / target,
        "self_bytes_per_token_mb": None,
        "self_bound_tok_s": None,
    }
    if accepted_length:
        per_round = num_drafts * draft + target
        figures["self_bytes_per_token_mb"] = per_round / (batch * accepted_length) / 1e6
        figures["self_bound_tok_s"] = bandwidth * batch * accepted_length / per_round
    return figures
