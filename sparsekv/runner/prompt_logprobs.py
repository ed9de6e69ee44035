"""Log-probabilities of prompt tokens, computed from a prefill step's hidden states.

A row at position ``p`` predicts the token at ``p + 1``; every prefill row whose next token is
still part of the prompt yields one record. Logits are computed a few rows at a time and only
the target's logprob and the top-N survive each chunk: a 4k-token prompt on Gemma 3's 262k
vocabulary would otherwise hold 4 GB of fp32 logits.
"""

from __future__ import annotations

import torch

from sparsekv.outputs import Logprob

# fp32 logits held at once per chunk (16M floats = 64 MB): 64 rows of Gemma 3, 341 of SmolLM2.
MAX_CHUNK_LOGITS = 1 << 24


def prompt_logprob_rows(first: int, num_new: int, num_prompt: int) -> range:
    """Rows (offsets in the step's slice) whose next token is a prompt token.

    Args:
        first: position of the slice's first token.
        num_new: tokens of the slice.
        num_prompt: prompt length.
    """
    return range(0, max(0, min(num_new, num_prompt - 1 - first)))


@torch.inference_mode()
def prompt_logprobs(model, hidden: torch.Tensor, targets: list[int], num_top: int) -> list[Logprob]:
    """One record per row of ``hidden``.

    Args:
        model: has ``compute_logits(hidden [n, d]) -> fp32 [n, vocab]``.
        hidden: ``[n, hidden]`` final hidden states of consecutive prompt positions.
        targets: the prompt token each row predicts (``n`` ids).
        num_top: most likely alternatives to keep per position (0-20).

    Returns:
        ``Logprob(target, logprob, top, rank)`` per row: natural-log ``log_softmax`` of the raw
        logits (no temperature or penalties), as for sampled tokens.
    """
    records: list[Logprob] = []
    if not targets:
        return records
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0) or 1 << 18
    step = max(1, MAX_CHUNK_LOGITS // vocab)
    target_ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for start in range(0, len(targets), step):
        end = min(start + step, len(targets))
        logprobs = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)
        chosen_t = logprobs.gather(1, target_ids[start:end, None])
        ranks = (logprobs > chosen_t).sum(dim=-1).add_(1).tolist()
        chosen = chosen_t[:, 0].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in range(end - start)]
        if num_top > 0:
            values, ids = logprobs.topk(num_top, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        del logprobs
        for offset, (value, top, rank) in enumerate(zip(chosen, tops, ranks)):
            target = targets[start + offset]
            records.append(Logprob(token_id=target, logprob=value, top=top, rank=rank))
    return records
