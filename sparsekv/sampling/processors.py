"""Logits transforms of the sampler, in the order vLLM applies them.

Each takes fp32 logits and returns new logits (the caller's tensor is never written), so the
raw logits stay available for logprobs. All are vectorized over the batch.
"""

from __future__ import annotations

import torch

from sparsekv.sampling.batch import SamplingBatch


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, then presence and frequency penalties.

    Repetition follows CTRL / Hugging Face ``RepetitionPenaltyLogitsProcessor``: every token of
    the prompt or output has a positive logit divided by the penalty and a negative one
    multiplied by it. Presence and frequency follow the OpenAI API over the output tokens:
    ``logit - count * frequency - (count > 0) * presence``.

    Args:
        logits: ``[B, V]`` fp32.
        batch: the step's sampling batch.

    Returns:
        ``[B, V]`` fp32 penalized logits.
    """
    vocab_size = logits.shape[1]
    if batch.repetition_penalty is not None:
        seen = _token_counts(batch.seen_token_ids, vocab_size) > 0
        penalty = batch.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.presence_penalty is not None:
        counts = _token_counts(batch.output_token_ids, vocab_size)
        logits = (
            logits
            - counts * batch.frequency_penalty[:, None]
            - (counts > 0).float() * batch.presence_penalty[:, None]
        )
    return logits


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Masks EOS and stop token ids to ``-inf`` in rows below their ``min_tokens``.

    Args:
        logits: ``[B, V]`` fp32.
        batch: the step's sampling batch (``banned_rows`` / ``banned_token_ids``).

    Returns:
        ``[B, V]`` fp32.
    """
    if batch.banned_rows is None:
        return logits
    rows, tokens = batch.banned_rows, batch.banned_token_ids
    in_vocab = tokens < logits.shape[1]
    logits = logits.clone()
    logits[rows[in_vocab], tokens[in_vocab]] = float("-inf")
    return logits


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Zeroes tokens less likely than ``min_p`` times the row's top probability.

    Args:
        probs: ``[R, V]`` fp32 probabilities.
        min_p: ``[R]`` fp32, ``0`` = off; or ``None``.

    Returns:
        ``[R, V]`` fp32, not renormalized (the sampler's race does not need it).
    """
    if min_p is None:
        return probs
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, L]`` padded ids -> ``[B, V]`` fp32 occurrence counts (pads and ids >= V dropped)."""
    outside = (token_ids < 0) | (token_ids >= vocab_size)
    ids = token_ids.masked_fill(outside, vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]
