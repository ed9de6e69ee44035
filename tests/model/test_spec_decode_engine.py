"""Speculative decoding in the engine on tiny random models (fp32): greedy output with the
n-gram drafter equals plain decoding token for token, with and without compression, on full and
sliding-window layers, in mixed batches, across preemption and prefix-cache hits, with chunked
prefill; logprobs of accepted tokens, stop strings, ``n > 1`` and seeded sampling."""

from __future__ import annotations

import pytest

from sparsekv.config import CompressionConfig, SpeculativeConfig
from sparsekv.sampling_params import SamplingParams
from tests.model.spec_models import (
    NGRAM,
    engine,
    generate,
    repetitive_prompts,
    tiny_checkpoint,
    token_ids,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)
SNAPKV = CompressionConfig(method="snapkv", budget=24, window=8, full_layers=1)
H2O = CompressionConfig(method="h2o", budget=24, window=8, full_layers=1)
NO_DECODE_EVICTION = CompressionConfig(
    method="snapkv", budget=24, window=8, full_layers=1, decode_eviction=False
)


@pytest.fixture(scope="module", params=["qwen2", "gemma2"])
def checkpoint(request):
    """A full-attention model and one with sliding-window layers and a logit soft-cap."""
    return tiny_checkpoint(request.param, seed=1)


def _check_greedy_equal(checkpoint, prompts, params, **settings):
    plain = token_ids(generate(engine(checkpoint, **settings), prompts, params))
    spec = engine(checkpoint, speculative=NGRAM, **settings)
    assert token_ids(generate(spec, prompts, params)) == plain
    return spec


@pytest.mark.parametrize(
    "compression",
    [None, SNAPKV, H2O, NO_DECODE_EVICTION],
    ids=["full", "snapkv", "h2o", "no-decode-eviction"],
)
def test_greedy_equals_plain_in_a_mixed_batch(checkpoint, compression):
    prompts = repetitive_prompts([40, 13, 55, 29])
    params = [SamplingParams(max_tokens=30, **GREEDY) for _ in prompts]
    params[1] = SamplingParams(max_tokens=30, speculative={"method": None}, **GREEDY)
    spec = _check_greedy_equal(checkpoint, prompts, params, compression=compression)
    stats = spec.stats.spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec.stats.num_generation_tokens == 30 * len(prompts)
    assert stats.mean_accepted_length == 1 + stats.num_accepted_tokens / stats.num_drafts


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_equals_plain_across_preemption(checkpoint, mode):
    prompts = repetitive_prompts([30, 26, 34, 22], seed=2)
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in prompts]
    settings = dict(num_pages=75, preemption_mode=mode)
    plain = engine(checkpoint, **settings)
    expected = token_ids(generate(plain, prompts, params))
    spec = engine(checkpoint, speculative=NGRAM, **settings)
    assert token_ids(generate(spec, prompts, params)) == expected
    assert spec.stats.num_preemptions > 0 and spec.stats.spec_decode.num_drafts > 0


def test_greedy_equals_plain_with_prefix_hits_and_chunked_prefill(checkpoint):
    prompt = repetitive_prompts([45], seed=3)[0]
    params = SamplingParams(max_tokens=24, **GREEDY)
    settings = dict(max_num_batched_tokens=16)
    plain = token_ids(generate(engine(checkpoint, **settings), [prompt], [params]))[0]
    spec = engine(checkpoint, speculative=NGRAM, **settings)
    first = token_ids(generate(spec, [prompt], [params]))[0]
    spec.add_request("again", prompt, params)
    while spec.has_unfinished_requests():
        outputs = spec.step()
    assert first == plain and outputs[0].outputs[0].token_ids == plain
    if spec.kv.prefix_cache is not None:  # off for models with sliding-window layers
        assert spec.stats.num_prefix_cache_hit_tokens > 0


def test_logprobs_stop_strings_and_n(checkpoint):
    prompts = repetitive_prompts([33, 47], seed=4)
    params = [
        SamplingParams(max_tokens=25, logprobs=2, **GREEDY),
        SamplingParams(max_tokens=25, n=2, **GREEDY),
    ]
    plain = generate(engine(checkpoint), prompts, params)
    spec_engine = engine(checkpoint, speculative=NGRAM)
    spec = generate(spec_engine, prompts, params)
    assert spec_engine.stats.spec_decode.num_accepted_tokens > 0
    ours, reference = spec["r0"].outputs[0], plain["r0"].outputs[0]
    assert ours.token_ids == reference.token_ids
    assert len(ours.logprobs) == 25
    for mine, theirs in zip(ours.logprobs, reference.logprobs):
        assert mine.token_id == theirs.token_id
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    assert [o.token_ids for o in spec["r1"].outputs] == [o.token_ids for o in plain["r1"].outputs]
    # A stop string cuts the text at the same place although drafts ran past it.
    text = reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 6].strip()
    stopped = [SamplingParams(max_tokens=25, stop=[stop], **GREEDY)]
    cut = generate(engine(checkpoint), prompts[:1], stopped)["r0"].outputs[0]
    spec_cut = generate(engine(checkpoint, speculative=NGRAM), prompts[:1], stopped)
    assert spec_cut["r0"].outputs[0].text == cut.text
    assert spec_cut["r0"].outputs[0].finish_reason == cut.finish_reason == "stop"


def test_seeded_sampling_repeats_and_respects_max_tokens(checkpoint):
    prompts = repetitive_prompts([31, 40], seed=5)
    params = [SamplingParams(max_tokens=20, temperature=0.7, seed=7, ignore_eos=True)] * 2
    first = token_ids(generate(engine(checkpoint, speculative=NGRAM), prompts, params))
    again = token_ids(generate(engine(checkpoint, speculative=NGRAM), prompts, params))
    assert first == again and all(len(tokens) == 20 for tokens in first)


def test_speculative_request_settings_are_validated(checkpoint):
    plain = engine(checkpoint)
    prompt = repetitive_prompts([20])[0]
    with pytest.raises(ValueError, match="speculative.draft"):
        plain.add_request("a", prompt, SamplingParams(speculative={"draft": 1}))
    with pytest.raises(ValueError, match="speculative.method must be one of ngram"):
        plain.add_request("b", prompt, SamplingParams(speculative={"method": "eagle"}))
    with pytest.raises(ValueError, match="speculative must be an object"):
        plain.add_request("c", prompt, SamplingParams(speculative=3))
    # Opt in on an engine started without speculation.
    params = SamplingParams(max_tokens=12, speculative={"method": "ngram"}, **GREEDY)
    generate(plain, [prompt], [params])
    assert plain.stats.spec_decode.num_drafts > 0
    with pytest.raises(ValueError, match="int4"):
        engine(checkpoint, speculative=NGRAM, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="ngram_prompt_lookup_max"):
        SpeculativeConfig(
            method="ngram", ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2
        ).validate()
