"""What ``LLMEngine.step`` does with the runner's result for one sample, and what the engine
reports of its cache.

``append_step_tokens`` appends a sample's token of the step (or a verifying sample's accepted
tokens); ``finished_kv_stats`` is what a finishing sample reports of its cache; ``kv_usage``
is the pool occupancy and the compression of the running requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparsekv.engine import output_processor as op
from sparsekv.engine.request import Request
from sparsekv.engine.stats import EngineStats
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.kv_cache.request_kv import RequestKV
from sparsekv.outputs import KVStats

if TYPE_CHECKING:
    from sparsekv.runner.model_runner import RunnerOutput


def append_step_tokens(
    state: op.SampleState, result: RunnerOutput, max_model_len: int, stats: EngineStats
) -> str | None:
    """Append the step's token (or a verifying request's accepted tokens, up to the first
    that finishes it), counting them in ``stats``; returns the finish reason or ``None``."""
    request = state.request
    verified = result.verified.get(request.request_id)
    if verified is not None:
        logprobs = verified.logprobs or [None] * len(verified.token_ids)
        for token, logprob in zip(verified.token_ids, logprobs):
            reason = op.append_token(state, token, logprob, max_model_len)
            stats.num_generation_tokens += 1
            if reason is not None:
                return reason
        return None
    token = result.token_ids[request.request_id]
    if request.forced_token_ids is not None:
        forced = request.forced_token_ids
        token = forced[min(request.num_output_tokens, len(forced) - 1)]
    if request.request_id in result.logits:
        request.logits.append(result.logits[request.request_id])
    logprob = result.logprobs.get(request.request_id)
    stats.num_generation_tokens += 1
    return op.append_token(state, token, logprob, max_model_len)


def finished_kv_stats(request: Request, request_kv: RequestKV) -> KVStats:
    """The cache a finishing request reports: slots kept and evicted per layer, and the
    tokens whose K/V were computed.

    The last sampled token never enters the cache, so an uncompressed request reports a ratio
    of exactly 0. A verification step that finished the request inside its accepted draft
    also wrote the draft tokens past the finish; they are no part of the request, and its
    newest slots in every layer.
    """
    logical = len(request.prompt_token_ids) + max(request.num_output_tokens - 1, 0)
    num_tokens = min(request.num_computed_tokens, logical)
    overshoot = request.num_computed_tokens - num_tokens
    return KVStats(
        kept_per_layer=[max(0, k - overshoot) for k in request_kv.kept_per_layer()],
        evicted_per_layer=request_kv.evicted_per_layer(),
        num_tokens=num_tokens,
    )


def kv_usage(running: list[Request], kv: KVCacheManager) -> dict[str, float]:
    """Pool occupancy and the fraction of the ``running`` requests' full caches removed by
    compression (slots evicted over ``num_layers * tokens``; sliding-window layers dropping
    pages past their window do not count).

    Returns:
        ``pages_used``, ``pages_total`` and ``compression_ratio`` (in ``[0, 1]``).
    """
    evicted = full = 0
    for request in running:
        if kv.has(request.request_id):
            request_kv = kv.get(request.request_id)
            evicted += sum(request_kv.evicted_per_layer())
            full += len(request_kv.layers) * request.num_computed_tokens
    return {
        "pages_used": kv.num_total_pages - kv.num_free_pages,
        "pages_total": kv.num_total_pages,
        "compression_ratio": 0.0 if full == 0 else min(1.0, evicted / full),
    }
