"""Turn sampled tokens into request state and ``RequestOutput``s.

Appends each sampled (or teacher-forced) token, runs the incremental detokenizer, applies the
stop conditions (stop strings, stop token ids, EOS after ``min_tokens``, ``max_tokens``, the
context length) and groups the samples of an ``n > 1`` request into one ``RequestOutput``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sparsekv.engine.detokenizer import IncrementalDetokenizer
from sparsekv.engine.request import Request
from sparsekv.outputs import CompletionOutput, KVStats, Logprob, RequestOutput


@dataclass
class SampleState:
    """Output-side state of one sample."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[Logprob] | None = None
    num_sent_tokens: int = 0
    pending_text: str = ""
    kv_stats: KVStats | None = None
    # the request's stop_token_ids as a set: checked after every token, and a request may
    # list thousands of ids
    stop_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.request.sampling_params.stop_token_ids)


@dataclass
class RequestGroup:
    """The samples of one user request."""

    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleState]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    error: str | None = None
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


def append_token(
    state: SampleState, token_id: int, logprob: Logprob | None, max_model_len: int
) -> str | None:
    """Append one token; return the finish reason if the sample is now finished."""
    request = state.request
    params = request.sampling_params
    request.output_token_ids.append(token_id)
    if state.logprobs is not None and logprob is not None:
        state.logprobs.append(logprob)
    step = state.detokenizer.append(token_id)
    state.pending_text += step.delta_text
    num_out = request.num_output_tokens
    if step.stop is not None:
        request.stop_reason = step.stop
        return "stop"
    if token_id in state.stop_ids:
        request.stop_reason = token_id
        return "stop"
    if not params.ignore_eos and token_id in request.eos_token_ids and num_out >= params.min_tokens:
        return "stop"
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    return None


def flush(state: SampleState) -> None:
    """Release held-back text at the end of a sample (no stop string matched)."""
    state.pending_text += state.detokenizer.flush()


def cacheable_token_ids(state: SampleState, tokenizer, block_size: int) -> list[int]:
    """Tokens of a normally finished sample whose K/V may enter the prefix cache.

    Those whose K/V were computed (the last sampled token never was). After a stop string,
    only up to the last page boundary whose output text is a prefix of the returned text, so
    no cached page holds tokens past the stop.

    Args:
        state: the finished sample.
        tokenizer: decodes candidate outputs (as the detokenizer does).
        block_size: tokens per page (only page-aligned ends are tried).
    """
    request = state.request
    tokens = request.token_slice(0, request.num_computed_tokens)
    if not isinstance(request.stop_reason, str):
        return tokens
    n_prompt = request.num_prompt_tokens
    text = state.detokenizer.text
    skip = request.sampling_params.skip_special_tokens
    for end in range(len(tokens) // block_size * block_size, n_prompt, -block_size):
        if text.startswith(tokenizer.decode(tokens[n_prompt:end], skip_special_tokens=skip)):
            return tokens[:end]
    return tokens[:n_prompt]


def add_prompt_logprobs(group: RequestGroup, start: int, records: list[Logprob]) -> None:
    """Store the records of prompt positions ``start ..``; positions already stored (a
    preempted request recomputing its prompt) are kept as they are."""
    stored = group.prompt_logprobs
    if stored is None or start > len(stored):
        return
    stored.extend(records[len(stored) - start :])


def build_output(group: RequestGroup) -> RequestOutput:
    """Snapshot of a group, with deltas since the previous snapshot."""
    outputs = []
    for index, state in enumerate(group.samples):
        request = state.request
        num_tokens = request.num_output_tokens
        outputs.append(
            CompletionOutput(
                index=index,
                text=state.detokenizer.text,
                token_ids=list(request.output_token_ids),
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
                logprobs=list(state.logprobs) if state.logprobs is not None else None,
                delta_text=state.pending_text,
                num_delta_tokens=num_tokens - state.num_sent_tokens,
            )
        )
        state.pending_text = ""
        state.num_sent_tokens = num_tokens
    stats = [s.kv_stats for s in group.samples if s.kv_stats is not None]
    metrics = {"arrival": group.arrival_time}
    if group.first_token_time is not None:
        metrics["first_token"] = group.first_token_time
    if group.last_token_time is not None:
        metrics["last_token"] = group.last_token_time
    return RequestOutput(
        request_id=group.request_id,
        prompt_token_ids=group.prompt_token_ids,
        outputs=outputs,
        finished=group.finished,
        kv_stats=_merge_stats(stats) if stats else None,
        error=group.error,
        metrics=metrics,
        prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
        # Once per request: the first sample's hit (the others take its pages).
        num_cached_tokens=group.samples[0].request.num_cached_tokens or 0,
    )


def _merge_stats(stats: list[KVStats]) -> KVStats:
    if len(stats) == 1:
        return stats[0]
    kept = [sum(col) for col in zip(*(s.kept_per_layer for s in stats))]
    evicted = [sum(col) for col in zip(*(s.evicted_per_layer for s in stats))]
    return KVStats(kept, evicted, sum(s.num_tokens for s in stats))
