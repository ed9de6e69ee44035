"""Top-k and top-p (nucleus) truncation without sorting the whole vocabulary.

The ranking is by logit, descending, equal logits by lower token id, so ``top_k = 1`` (or a
tiny ``top_p``) keeps exactly the ``torch.argmax`` token. Top-p keeps the smallest prefix of
the ranking whose probability sums to at least ``top_p`` (Holtzman et al. 2020, "The Curious
Case of Neural Text Degeneration"), computed after the top-k mask.

A full sort of ``[R, V]`` costs ~10x a ``topk`` of ``NUM_CANDIDATES``, so rows work on their
top ``NUM_CANDIDATES`` candidates and fall back to the sort only when the kept set may leave
them (a larger ``top_k``, a nucleus wider than the candidates, or a tie with the last
candidate). Which path a row takes depends on that row alone, so its result does not depend
on the other rows of the batch.
"""

from __future__ import annotations

import torch

NUM_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks tokens outside each row's top-k, then outside its nucleus.

    Args:
        logits: ``[R, V]`` fp32 (already divided by the temperature).
        top_k: ``[R]`` int64, ``<= 0`` = off; or ``None``.
        top_p: ``[R]`` fp32, ``>= 1`` = off; or ``None``.

    Returns:
        ``[R, V]`` fp32 with removed tokens at ``-inf`` (rows with both off unchanged).
    """
    if top_k is None and top_p is None:
        return logits
    num_rows, vocab_size = logits.shape
    k = torch.full((num_rows,), vocab_size, dtype=torch.int64, device=logits.device)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), k)
    p = torch.full((num_rows,), float("inf"), device=logits.device)
    if top_p is not None:
        # top_p = 1 is off: rounding can push the tail's cumulative mass to 1.0.
        p = torch.where(top_p < 1.0, top_p, p)
    num_candidates = min(NUM_CANDIDATES, vocab_size)
    by_sort = (k < vocab_size) & (k >= num_candidates)
    by_candidates = ((k < num_candidates) | (p < 1.0)) & ~by_sort
    out = logits.clone()
    rows = by_candidates.nonzero().squeeze(1)
    if len(rows):
        out[rows], unsure = _truncate_candidates(logits[rows], k[rows], p[rows], num_candidates)
        by_sort[rows[unsure]] = True
    rows = by_sort.nonzero().squeeze(1)
    if len(rows):
        out[rows] = truncate_sorted(logits[rows], k[rows], p[rows])
    return out


def truncate_sorted(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Reference truncation over a full stable sort.

    Args:
        logits: ``[R, V]`` fp32.
        k: ``[R]`` int64 in ``[1, V]``.
        p: ``[R]`` fp32, ``inf`` = off.

    Returns:
        ``[R, V]`` fp32 with removed tokens at ``-inf``.
    """
    vocab_size = logits.shape[1]
    ranked, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device)
    ranked = ranked.masked_fill(rank >= k[:, None], float("-inf"))
    ranked = ranked.masked_fill(~_nucleus(ranked, ranked.logsumexp(dim=-1), p), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ranked)


def _truncate_candidates(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncation over the top ``num_candidates`` (every ``k < num_candidates`` or off).

    Returns:
        ``[R, V]`` fp32 truncated logits and ``[R]`` bool: rows whose kept set may reach past
        the candidates (their result is not valid; the caller sorts them).
    """
    vocab_size = logits.shape[1]
    values, ids = _ranked_candidates(logits, num_candidates)
    last_candidate = values[:, -1].clone()
    rank = torch.arange(num_candidates, device=logits.device)
    values = values.masked_fill(rank >= k[:, None], float("-inf"))
    # Rows with top-k keep their whole distribution among the candidates; others need the row.
    log_norm = torch.where(k < vocab_size, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    kept = _nucleus(values, log_norm, p) & (rank < k[:, None])
    num_kept = kept.sum(dim=-1)
    last_kept = values.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    # An unseen token may tie the last candidate: the kept set must end strictly above it.
    unsure = (last_kept <= last_candidate) & (num_candidates < vocab_size)
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(1, ids, values.masked_fill(~kept, float("-inf")))
    return out, unsure


def _ranked_candidates(logits: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num`` largest logits per row ranked by value, ties by lower id.

    Returns:
        ``([R, num] fp32 values, [R, num] int64 ids)``.
    """
    values, ids = logits.topk(num, dim=-1)  # tie order unspecified: canonicalize below
    ids, order = ids.sort(dim=-1)
    values, order2 = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order2)


def _nucleus(ranked: torch.Tensor, log_norm: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``[R, n]`` bool: ranks whose preceding probability mass is below ``p`` (rank 0 always)."""
    probs = (ranked - log_norm[:, None]).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    kept = mass_before < p[:, None]
    kept[:, 0] = True
    return kept
