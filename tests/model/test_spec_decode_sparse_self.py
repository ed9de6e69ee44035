"""Sparse self-speculation in the engine on tiny random models (fp32): the model drafts over a
sink + recent view of its own cache, and greedy output equals plain decoding token for token,
with and without compression, on full and sliding-window layers, in batches mixing drafting and
plain requests, across preemption and prefix-cache hits."""

from __future__ import annotations

import dataclasses
import time

import pytest

from sparsekv.config import CompressionConfig, SpeculativeConfig
from sparsekv.sampling_params import SamplingParams
from sparsekv.spec_decode import self_draft
from tests.model.spec_models import engine, generate, repetitive_prompts, tiny_checkpoint, token_ids

GREEDY = dict(temperature=0.0, ignore_eos=True)
SNAPKV = CompressionConfig(method="snapkv", budget=24, window=8, full_layers=1)
H2O = CompressionConfig(method="h2o", budget=24, window=8, full_layers=1)
# With 4-slot pages the view of a 40-token prompt leaves out some of its pages.
SELF = SpeculativeConfig(
    method="sparse_self", num_speculative_tokens=3, draft_sink_tokens=4, draft_recent_tokens=16
)


@pytest.fixture(scope="module", params=["qwen2", "gemma2"])
def checkpoint(request):
    """A full-attention model and one with sliding-window layers and a logit soft-cap."""
    return tiny_checkpoint(request.param, seed=1)


def _prompts(lengths, seed=0):
    """Prompts whose first half is random and second half repeats (drafts both hit and miss)."""
    noise = repetitive_prompts(lengths, seed=seed, period=97)
    loops = repetitive_prompts(lengths, seed=seed + 50, period=5)
    return [a[: len(a) // 2] + b[: len(b) - len(a) // 2] for a, b in zip(noise, loops)]


@pytest.mark.parametrize("compression", [None, SNAPKV, H2O], ids=["full", "snapkv", "h2o"])
def test_greedy_equals_plain_in_a_mixed_batch(checkpoint, compression):
    prompts = _prompts([40, 13, 55, 29])
    params = [SamplingParams(max_tokens=24, **GREEDY) for _ in prompts]
    params[1] = SamplingParams(max_tokens=24, speculative={"method": None}, **GREEDY)
    params[3] = SamplingParams(max_tokens=24, speculative={"method": "ngram"}, **GREEDY)
    plain = token_ids(generate(engine(checkpoint, compression=compression), prompts, params))
    spec = engine(checkpoint, speculative=SELF, compression=compression)
    assert token_ids(generate(spec, prompts, params)) == plain
    stats = spec.stats.spec_decode
    assert stats.num_drafts > 0 and stats.draft_seconds > 0
    if compression is None:  # compressed layers near their budget drop most drafts
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec.stats.num_generation_tokens == 24 * len(prompts)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_equals_plain_across_preemption(checkpoint, mode):
    prompts = repetitive_prompts([30, 26, 34, 22], seed=2)
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in prompts]
    settings = dict(num_pages=75, preemption_mode=mode)
    expected = token_ids(generate(engine(checkpoint, **settings), prompts, params))
    spec = engine(checkpoint, speculative=SELF, **settings)
    assert token_ids(generate(spec, prompts, params)) == expected
    assert spec.stats.num_preemptions > 0 and spec.stats.spec_decode.num_drafts > 0


def test_greedy_equals_plain_with_prefix_hits_and_chunked_prefill(checkpoint):
    prompt = _prompts([45], seed=3)[0]
    params = SamplingParams(max_tokens=24, **GREEDY)
    settings = dict(max_num_batched_tokens=16)
    plain = token_ids(generate(engine(checkpoint, **settings), [prompt], [params]))[0]
    spec = engine(checkpoint, speculative=SELF, **settings)
    first = token_ids(generate(spec, [prompt], [params]))[0]
    spec.add_request("again", prompt, params)
    while spec.has_unfinished_requests():
        outputs = spec.step()
    assert first == plain and outputs[0].outputs[0].token_ids == plain
    if spec.kv.prefix_cache is not None:  # off for models with sliding-window layers
        assert spec.stats.num_prefix_cache_hit_tokens > 0


def test_a_wider_view_accepts_more(checkpoint):
    """A view holding the whole cache drafts what the target computes: every draft is
    accepted (up to float rounding of the batched paths)."""
    prompts = _prompts([40, 33])
    params = [SamplingParams(max_tokens=20, **GREEDY) for _ in prompts]
    narrow = engine(checkpoint, speculative=SELF)
    generate(narrow, prompts, params)
    whole = SpeculativeConfig(method="sparse_self", num_speculative_tokens=3)
    wide = engine(checkpoint, speculative=whole)
    generate(wide, prompts, params)
    wide_stats, narrow_stats = wide.stats.spec_decode, narrow.stats.spec_decode
    assert wide_stats.num_accepted_tokens == wide_stats.num_draft_tokens
    assert narrow_stats.num_accepted_tokens < narrow_stats.num_draft_tokens


def test_a_reduced_draft_vocabulary_keeps_greedy_output(checkpoint, monkeypatch):
    # Drafts come from each request's leading token ids only (one head product per forward,
    # narrower requests masked); the verification still scores the whole vocabulary.
    drafted = []
    argmax = self_draft._argmax_drafts

    def spy(model, hidden, vocabs):
        tokens = argmax(model, hidden, vocabs)
        drafted.extend(zip(tokens, vocabs))
        return tokens

    monkeypatch.setattr(self_draft, "_argmax_drafts", spy)
    prompts = _prompts([40, 13, 55])
    plain_params = [SamplingParams(max_tokens=24, **GREEDY) for _ in prompts]
    plain = token_ids(generate(engine(checkpoint), prompts, plain_params))
    params = [*plain_params]
    params[1] = SamplingParams(max_tokens=24, speculative={"draft_vocab_size": 0}, **GREEDY)
    params[2] = SamplingParams(max_tokens=24, speculative={"draft_vocab_size": 200}, **GREEDY)
    narrow = dataclasses.replace(SELF, draft_vocab_size=60)
    spec = engine(checkpoint, speculative=narrow)
    assert token_ids(generate(spec, prompts, params)) == plain
    assert {vocab for _, vocab in drafted} == {64, None, 208}
    assert all(vocab is None or token < vocab for token, vocab in drafted)
    assert any(vocab is None and token >= 208 for token, vocab in drafted)
    assert spec.stats.spec_decode.num_accepted_tokens > 0


def test_sampled_requests_repeat_and_respect_max_tokens(checkpoint):
    prompts = _prompts([31, 40], seed=5)
    params = [SamplingParams(max_tokens=20, temperature=0.7, seed=7, ignore_eos=True)] * 2
    first = token_ids(generate(engine(checkpoint, speculative=SELF), prompts, params))
    again = token_ids(generate(engine(checkpoint, speculative=SELF), prompts, params))
    assert first == again and all(len(tokens) == 20 for tokens in first)


def test_per_request_settings(checkpoint):
    plain = engine(checkpoint)
    prompt = _prompts([30])[0]
    with pytest.raises(ValueError, match="speculative.draft_sink_tokens must be an integer >= 0"):
        plain.add_request(
            "a",
            prompt,
            SamplingParams(speculative={"method": "sparse_self", "draft_sink_tokens": -1}),
        )
    opt_in = {"method": "sparse_self", "draft_recent_tokens": 4, "num_speculative_tokens": 2}
    params = SamplingParams(max_tokens=12, speculative=opt_in, **GREEDY)
    expected = token_ids(
        generate(engine(checkpoint), [prompt], [SamplingParams(max_tokens=12, **GREEDY)])
    )
    assert token_ids(generate(plain, [prompt], [params])) == expected
    stats = plain.stats.spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens <= 2 * stats.num_drafts


def test_verify_time_leaves_out_the_draft_forwards(checkpoint, monkeypatch):
    # Draft forwards made 200 ms slower: they count as drafting, not as the verifying step.
    fill = self_draft.fill_self_drafts

    def slow_fill(*args, **kwargs):
        time.sleep(0.2)
        return fill(*args, **kwargs) + 0.2

    monkeypatch.setattr(self_draft, "fill_self_drafts", slow_fill)
    spec = engine(checkpoint, speculative=SELF)
    generate(spec, _prompts([40]), [SamplingParams(max_tokens=8, **GREEDY)])
    stats = spec.stats.spec_decode
    assert stats.num_verify_steps > 0
    assert stats.draft_seconds >= 0.2 * stats.num_verify_steps > stats.verify_seconds > 0
