"""Verification of draft tokens against the target model's logits.

A request that carried ``k`` drafts ``d_1 .. d_k`` into a step gets ``k + 1`` logits rows: row
``i`` is the target's prediction after the request's tokens and ``d_1 .. d_i``. Verification
keeps a prefix of the drafts and appends one token of the target's own, so every step emits
between 1 and ``k + 1`` tokens:

- greedy: the longest prefix where ``d_{i+1}`` is the argmax of row ``i``, then that row's
  argmax (the correction, or the bonus token after ``k`` accepted drafts). The output equals
  plain greedy decoding token for token.
- sampled: rejection sampling (Leviathan et al., 2023, "Fast Inference from Transformers via
  Speculative Decoding"; Chen et al., 2023, "Accelerating Large Language Model Decoding with
  Speculative Sampling"). Draft ``d`` is accepted with probability ``min(1, p(d) / q(d))``;
  on rejection the token is drawn from ``(p - q)+`` normalized. The drafters here are
  deterministic (``q`` one-hot on ``d``), so acceptance has probability ``p(d)`` and the
  residual is ``p`` with ``d`` removed. Every emitted token is distributed exactly as the
  target's ``p``, where ``p`` is the sampler's distribution (penalties, temperature, top-k,
  top-p, min-p) given the tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsekv.engine.request import Request
from sparsekv.sampling.batch import SamplingBatch
from sparsekv.sampling.sampler import Sampler, SamplerOutput, add_logprobs, target_probs


def accept_greedy(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """Tokens a greedy request emits after verifying ``draft_ids``.

    Args:
        target_ids: ``k + 1`` argmax tokens, one per verified row.
        draft_ids: the ``k`` draft tokens.

    Returns:
        The accepted drafts followed by the target's token at the first mismatch (or the bonus
        token of row ``k``): ``1 .. k + 1`` ids.
    """
    assert len(target_ids) == len(draft_ids) + 1
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_ids[accepted]:
        accepted += 1
    return [*draft_ids[:accepted], target_ids[accepted]]


def accept_sampled(
    probs: torch.Tensor, draft_ids: Sequence[int], generator: torch.Generator | None
) -> list[int]:
    """Rejection sampling of deterministic drafts (one-hot draft distribution).

    Args:
        probs: ``[k + 1, V]`` fp32 target probabilities of each verified row (CPU).
        draft_ids: the ``k`` draft tokens.
        generator: the request's generator (``None``: torch's default CPU generator); one
            fp64 uniform per examined draft, one categorical draw for the final token.

    Returns:
        The accepted drafts followed by one token drawn from the residual of the first
        rejected row, or from row ``k`` when every draft was accepted.
    """
    assert probs.shape[0] == len(draft_ids) + 1
    emitted: list[int] = []
    for row, draft in enumerate(draft_ids):
        uniform = torch.rand((), dtype=torch.float64, generator=generator)
        if uniform.item() < probs[row, draft].item():
            emitted.append(int(draft))
            continue
        residual = probs[row].clone()
        residual[draft] = 0.0
        if residual.sum().item() <= 0.0:  # p(draft) rounds to 1: nothing else can be drawn
            emitted.append(int(draft))
            continue
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(probs[len(draft_ids)], 1, generator=generator)))
    return emitted


def verify_request(
    logits: torch.Tensor, request: Request, draft_ids: list[int]
) -> tuple[list[int], SamplerOutput | None]:
    """Verify one request's drafts with its sampling settings.

    Row ``i`` is processed as if ``d_1 .. d_i`` were already generated (penalties and
    ``min_tokens`` see them), exactly as plain decoding would process that position.

    Args:
        logits: ``[k + 1, V]`` target logits of the request's last token and its drafts.
        request: the request (sampling params, generator, prompt and output so far).
        draft_ids: the ``k`` drafts.

    Returns:
        (emitted token ids, a ``SamplerOutput`` whose rows hold each emitted token's
        logprob record, or ``None`` when the request asked for no logprobs).
    """
    params = request.sampling_params
    num_rows = len(draft_ids) + 1
    outputs = [request.output_token_ids + draft_ids[:i] for i in range(num_rows)]
    batch = SamplingBatch.from_requests(
        params=[params] * num_rows,
        generators=[None] * num_rows,  # the acceptance test draws from the request's own
        prompt_ids=[request.prompt_token_ids] * num_rows,
        output_ids=outputs,
        eos_token_ids=[list(request.eos_token_ids)] * num_rows,
        device=logits.device,
    )
    if params.is_greedy:
        target = Sampler()(logits, batch).token_ids.tolist()
        emitted = accept_greedy(target, draft_ids)
    else:
        probs = target_probs(logits, batch).cpu()
        emitted = accept_sampled(probs, draft_ids, request.generator)
    if params.logprobs is None:
        return emitted, None
    record = SamplerOutput(token_ids=torch.tensor(emitted, dtype=torch.int64))
    add_logprobs(record, logits[: len(emitted)].cpu(), params.logprobs)
    return emitted, record
