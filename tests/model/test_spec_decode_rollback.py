"""Rollback of rejected draft tokens: after a verification step that rejected drafts, the
request's KV state equals that of plain decoding to the same tokens (fp32): slot counts, page
tables, pool occupancy, the K/V of every held slot, the stored window queries and H2O
accumulators; a step that would compact never carries drafts."""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import CompressionConfig
from sparsekv.sampling_params import SamplingParams
from tests.model.spec_models import NGRAM, engine, repetitive_prompts, tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)
SNAPKV = CompressionConfig(method="snapkv", budget=24, window=8, full_layers=1)
H2O = CompressionConfig(method="h2o", budget=24, window=8, full_layers=1)


def _step_until_rejection(spec, request, num_rejections: int) -> None:
    stats = spec.stats.spec_decode
    while stats.num_draft_tokens - stats.num_accepted_tokens < num_rejections:
        assert not request.is_finished, "no draft was rejected"
        spec.step()


def _held(engine, request_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    state = engine.kv.get(request_id).layers[layer]
    return engine.kv.storage(layer).gather(state, state.block_table, state.num_held)


@pytest.mark.parametrize(
    ("family", "compression", "seed", "num_rejections"),
    [
        ("qwen2", None, 6, 3),
        ("qwen2", SNAPKV, 6, 3),
        ("qwen2", H2O, 6, 3),
        ("gemma2", SNAPKV, 3, 3),
    ],
    ids=["full", "snapkv", "h2o", "sliding-snapkv"],
)
def test_rollback_equals_a_run_without_the_rejected_tokens(
    family, compression, seed, num_rejections
):
    checkpoint = tiny_checkpoint(family)
    prompt = repetitive_prompts([37], seed=seed)[0]
    params = SamplingParams(max_tokens=60, **GREEDY)
    spec = engine(checkpoint, speculative=NGRAM, compression=compression, num_pages=400)
    spec.add_request("a", prompt, params)
    request = spec.scheduler.waiting[0]
    _step_until_rejection(spec, request, num_rejections)
    plain = engine(checkpoint, compression=compression, num_pages=400)
    plain.add_request("a", prompt, params)
    reference = plain.scheduler.waiting[0]
    while reference.num_output_tokens < request.num_output_tokens:
        plain.step()
    assert reference.output_token_ids == request.output_token_ids
    assert reference.num_computed_tokens == request.num_computed_tokens
    assert spec.kv.num_free_pages == plain.kv.num_free_pages
    spec.kv.check_invariants()
    ours, theirs = spec.kv.get("a"), plain.kv.get("a")
    for layer, (mine, expected) in enumerate(zip(ours.layers, theirs.layers)):
        counters = ("num_slots", "first_slot", "num_evicted")
        assert [getattr(mine, c) for c in counters] == [getattr(expected, c) for c in counters]
        assert len(mine.block_table) == len(expected.block_table)
        for got, want in zip(_held(spec, "a", layer), _held(plain, "a", layer)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if expected.recent_queries is None:
            assert mine.recent_queries is None
        else:
            torch.testing.assert_close(
                mine.recent_queries, expected.recent_queries, atol=1e-5, rtol=1e-5
            )
        if expected.accumulated is None:
            assert mine.accumulated is None
        else:
            torch.testing.assert_close(mine.accumulated, expected.accumulated, atol=1e-4, rtol=1e-4)
    if compression is not None:
        assert sum(state.num_evicted for state in ours.layers) > 0  # compacted along the way
    for e in (spec, plain):
        e.abort_request("a")
        assert e.kv.num_free_pages == e.kv.num_total_pages


def test_a_step_that_would_compact_carries_no_drafts():
    checkpoint = tiny_checkpoint("qwen2")
    spec = engine(checkpoint, speculative=NGRAM, compression=SNAPKV)
    prompt = repetitive_prompts([37], seed=6)[0]
    steps = []
    schedule = spec.scheduler.schedule

    def recording_schedule():
        out = schedule()
        for item in out.scheduled:
            compacts = any(step.compress_to is not None for step in item.layers)
            decoding = item.request.num_computed_tokens >= len(prompt)
            steps.append((compacts and decoding, len(item.draft_token_ids)))
        return out

    spec.scheduler.schedule = recording_schedule
    spec.add_request("a", prompt, SamplingParams(max_tokens=60, **GREEDY))
    while spec.has_unfinished_requests():
        spec.step()
    assert sum(compacts for compacts, _ in steps) >= 2
    assert all(num_drafts == 0 for compacts, num_drafts in steps if compacts)
    assert sum(num_drafts for _, num_drafts in steps) == spec.stats.spec_decode.num_draft_tokens > 0
