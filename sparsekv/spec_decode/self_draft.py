"""Sparse self-speculation: the target model drafts its own next tokens over a sparse view of
its own cache (``--speculative-method sparse_self``, docs/speculative.md).

The scheduler decides how many drafts a request carries (``drafting.max_draft_tokens``) and
allocates the verification step's ``k + 1`` slots as for any draft, with placeholder tokens.
Before the step's forward the runner calls :func:`fill_self_drafts`: ``k`` batched
single-token forwards over every ``sparse_self`` request of the step, forward ``j`` feeding
each request's last token (``j = 0``) or its draft ``j - 1`` at position
``num_computed_tokens + j`` and attending over the request's draft view
(``sparse_view.DraftAttention``, one per step: each layer's tables are built once). The
draft token is the argmax of the draft's logits, over the request's first
``draft_vocab_size`` token ids when it sets one (``models.head_rows``: one head product per
forward, as wide as its widest request). The verification then runs unchanged: greedy
requests keep the drafts that match the target's argmax, sampled ones accept draft ``d`` with
probability ``p(d)`` (a deterministic draft is a one-hot draft distribution, so rejection
sampling stays exact whatever drafted ``d``).
"""

from __future__ import annotations

import time

import torch

from sparsekv.engine.scheduler_output import ScheduledRequest
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.runner.kernel_scope import step_kernels
from sparsekv.spec_decode.sparse_view import DraftAttention, DraftRow

# A draft token the runner proposes before the step's forward (never an embedding row: a
# placeholder left unfilled fails the lookup instead of computing a wrong token).
SELF_DRAFT = -1


def is_self_drafting(item: ScheduledRequest) -> bool:
    """True when ``item`` carries ``sparse_self`` placeholders to fill."""
    return bool(item.draft_token_ids) and item.draft_token_ids[0] == SELF_DRAFT


@torch.inference_mode()
def fill_self_drafts(
    model: torch.nn.Module,
    kv: KVCacheManager,
    scheduled: list[ScheduledRequest],
    device: torch.device,
    logit_softcap: float | None = None,
) -> float:
    """Replace the placeholders of the step's ``sparse_self`` requests by their drafts.

    Args:
        model: the target model (``forward(input_ids, positions, ctx)``, ``compute_logits``).
        kv: the KV manager (storages, layer specs, request states).
        scheduled: the step's requests; those with placeholders get their
            ``draft_token_ids`` filled in place (others are not touched).
        device: the model's device.
        logit_softcap: the model's attention logit soft-cap, or ``None``.

    Returns:
        Seconds spent in the draft forwards (0 when no request drafts itself).
    """
    items = [item for item in scheduled if is_self_drafting(item)]
    if not items:
        return 0.0
    start = time.perf_counter()
    storages = [kv.storage(layer) for layer in range(kv.num_layers)]
    rows = [_row(kv, item) for item in items]
    ctx = DraftAttention(storages, kv.layer_specs, rows, kv.block_size, device, logit_softcap)
    vocab = {id(item): draft_vocab(item.request.speculative.draft_vocab_size) for item in items}
    for j in range(max(row.num_drafts for row in rows)):
        active = [items[i] for i in ctx.begin(j)]
        ids = torch.tensor([_input_token(item, j) for item in active], device=device)
        positions = [item.request.num_computed_tokens + j for item in active]
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        with step_kernels(storages[0].backend):
            hidden = model(ids, pos, ctx)
            drafts = _argmax_drafts(model, hidden, [vocab[id(item)] for item in active])
        for item, token in zip(active, drafts):
            item.draft_token_ids[j] = token
    return time.perf_counter() - start


def draft_vocab(draft_vocab_size: int) -> int | None:
    """Token ids a ``sparse_self`` draft proposes from.

    Args:
        draft_vocab_size: the request's ``speculative.draft_vocab_size`` (validated >= 0).

    Returns:
        ``n``: ids ``0 .. n - 1``, ``draft_vocab_size`` rounded up to a multiple of 16 (a
        packed head's group of rows); ``None``, the whole vocabulary, for 0 (or below).
    """
    return -(-draft_vocab_size // 16) * 16 if draft_vocab_size > 0 else None


def _argmax_drafts(
    model: torch.nn.Module, hidden: torch.Tensor, vocabs: list[int | None]
) -> list[int]:
    """Row ``i``'s argmax over token ids below ``vocabs[i]`` (``None``: all): one head product
    over the widest row's ids (``compute_logits(hidden, num_tokens)``, the whole vocabulary at
    or past its size), narrower rows masked to their own."""
    widest = None if None in vocabs else max(vocabs)
    logits = model.compute_logits(hidden, widest)
    width = logits.shape[-1]
    limits = [width if v is None else min(v, width) for v in vocabs]
    if min(limits) < width:
        ids = torch.arange(width, device=logits.device)
        bound = torch.tensor(limits, device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(ids >= bound, float("-inf"))
    return logits.argmax(dim=-1).tolist()


def _row(kv: KVCacheManager, item: ScheduledRequest) -> DraftRow:
    spec = item.request.speculative
    return DraftRow(
        kv=kv.get(item.request.request_id),
        layers=item.layers,
        num_drafts=len(item.draft_token_ids),
        sink_tokens=spec.draft_sink_tokens,
        recent_tokens=spec.draft_recent_tokens,
    )


def _input_token(item: ScheduledRequest, index: int) -> int:
    """Draft forward ``index``'s input: the request's last known token, then its drafts."""
    if index > 0:
        return item.draft_token_ids[index - 1]
    first = item.request.num_computed_tokens
    return item.request.token_slice(first, first + 1)[0]
