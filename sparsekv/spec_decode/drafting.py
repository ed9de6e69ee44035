"""Which requests draft in a step, and how many tokens.

A request drafts when it decodes (its prompt is computed and one token waits), speculation is
on for it, and nothing needs one step per token (teacher forcing, collected logits). The draft
length is capped so that the step cannot overshoot ``max_tokens`` (the bonus token included),
fits the step's token budget, and, for a compressed request, stays shorter than its
observation window (the rollback rebuilds the window from the chunk's rows). The scheduler
then keeps the drafts only when the longer step makes no layer compact and fits the pool
without preempting anyone.
"""

from __future__ import annotations

from sparsekv.engine.request import Request
from sparsekv.spec_decode.ngram import propose_ngram
from sparsekv.spec_decode.self_draft import SELF_DRAFT


def max_draft_tokens(request: Request, token_budget: int) -> int:
    """The most draft tokens ``request`` may carry into the next step (0: plain decode)."""
    spec = request.speculative
    if spec is None or not spec.enabled:
        return 0
    if request.forced_token_ids is not None or request.collect_logits:
        return 0
    in_decode = request.num_prompt_tokens <= request.num_computed_tokens == request.num_tokens - 1
    if not in_decode:
        return 0
    params = request.sampling_params
    limit = min(
        spec.num_speculative_tokens,
        params.max_tokens - request.num_output_tokens - 1,
        token_budget - 1,
    )
    if request.compression is not None:
        limit = min(limit, request.compression.window - 1)
    return max(0, limit)


def propose(request: Request, token_budget: int) -> list[int]:
    """Draft tokens for ``request``'s next step (empty: it decodes one token); for
    ``sparse_self``, placeholders the runner fills before the step's forward.

    Raises:
        ValueError: the request's speculative method has no drafter here.
    """
    num_tokens = max_draft_tokens(request, token_budget)
    if num_tokens == 0:
        return []
    spec = request.speculative
    if spec.method == "ngram":
        token_ids = request.prompt_token_ids + request.output_token_ids
        return propose_ngram(
            token_ids, num_tokens, spec.ngram_prompt_lookup_min, spec.ngram_prompt_lookup_max
        )
    if spec.method == "sparse_self":
        # The model drafts at the start of the step (``self_draft.fill_self_drafts``): the
        # scheduler only sizes the step.
        return [SELF_DRAFT] * num_tokens
    raise ValueError(f"speculative_method: no drafter for {spec.method!r}")
