"""The offline API under bad input and failures: a clear ``ValueError`` naming the parameter,
nothing left queued, and the ``LLM`` usable afterwards; an implicit ``max_tokens`` sized to the
pool; usage that does not depend on speculation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from sparsekv.config import CompressionConfig, SpeculativeConfig
from sparsekv.errors import PoolTooSmallError
from sparsekv.kv_cache.policy import implicit_max_tokens, resolve_policy
from sparsekv.llm import LLM
from sparsekv.sampling_params import SamplingParams
from tests.conftest import tiny_checkpoint, tiny_llama_config

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture
def tiny(smollm2_tokenizer):
    return tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=1)[0]


def _llm(engine) -> LLM:
    llm = LLM.__new__(LLM)  # the offline API around a test engine
    llm.engine, llm.tokenizer, llm._ids = engine, engine.tokenizer, itertools.count()
    return llm


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda llm: llm.generate(None, GREEDY), "^prompts: expected text, .* got NoneType$"),
        (lambda llm: llm.generate(5, GREEDY), "^prompts: expected text, .* got int$"),
        (lambda llm: llm.generate("a", {"max_tokens": 2}), "^sampling_params: expected a Sam"),
        (
            lambda llm: llm.generate("word " * 40, GREEDY, kv_compression={"budget": 40.5}),
            r"^kv_compression\.budget must be an integer, got 40\.5$",
        ),
        (
            lambda llm: llm.generate([{"role": "robot", "content": "hi"}], GREEDY),
            r"^messages\[0\]\.role: 'robot' is not one of system, developer, user",
        ),
        (
            lambda llm: llm.generate("hi", SamplingParams(n=10**6, max_tokens=1)),
            r"^n must be <= max_num_seqs \(64\), got 1000000$",
        ),
        (
            lambda llm: llm.generate("\ud800", GREEDY),
            r"^prompt: text is not valid Unicode \(it holds a lone surrogate\)$",
        ),
        (
            lambda llm: llm.generate([{"role": "user", "content": "a\ud800"}], GREEDY),
            r"^messages\[0\]\.content: text is not valid Unicode",
        ),
        (
            lambda llm: llm.generate([{"role": "user", "content": 5}], GREEDY),
            r"^messages\[0\]\.content: expected text, got int$",
        ),
        (
            lambda llm: llm.generate([1, "a"], GREEDY),
            r"^prompt: expected text, a list of token ids, or a list of chat messages, got int$",
        ),
    ],
)
def test_bad_input_is_a_value_error_and_leaves_the_llm_usable(make_engine, tiny, call, match):
    llm = _llm(make_engine(tiny, compression=CompressionConfig(budget=40, window=4)))
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate("hello there", GREEDY)[0].outputs[0].token_ids) == 4


def test_numpy_token_ids_are_a_prompt(make_engine, tiny):
    llm = _llm(make_engine(tiny))
    plain = llm.generate([5, 6, 7], GREEDY)[0]
    for prompt in (np.array([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)]):
        output = llm.generate(prompt, GREEDY)[0]
        assert output.prompt_token_ids == [5, 6, 7]
        assert all(type(t) is int for t in output.prompt_token_ids)
        assert output.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_failing_step_aborts_the_call_s_requests(make_engine, tiny, monkeypatch):
    engine = make_engine(tiny)
    llm = _llm(engine)
    step = engine.step

    def failing_step():
        raise RuntimeError("injected")

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["one prompt", "another prompt"], GREEDY)
    assert not engine.has_unfinished_requests()  # nothing left to fail the next call
    monkeypatch.setattr(engine, "step", step)
    outputs = llm.generate(["one prompt", "another prompt"], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]


def test_an_implicit_max_tokens_is_the_most_the_pool_holds(make_engine, tiny):
    engine = make_engine(tiny, num_pages=40)  # 640 slots over 3 layers: ~213 tokens of a full cache
    prompt = list(range(100, 150))
    chosen = implicit_max_tokens(engine.config, None, engine.kv, len(prompt), engine.max_model_len)
    assert chosen < engine.max_model_len - len(prompt)  # the context would allow more

    def policy(max_tokens):
        return resolve_policy(engine.config, None, engine.kv, len(prompt), max_tokens, 0)

    policy(chosen)  # fits
    with pytest.raises(PoolTooSmallError, match="^max_tokens: the request needs"):
        policy(chosen + 1)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    output = _llm(engine).generate(prompt, params)[0].outputs[0]
    assert (len(output.token_ids), output.finish_reason) == (chosen, "length")
    # A prompt the pool cannot hold even with one token after it is the prompt's fault.
    with pytest.raises(
        PoolTooSmallError,
        match=r"^prompt: its 500 tokens need \d+ KV pages at the peak with one output token but the pool has 40;",
    ):
        _llm(engine).generate(list(range(100, 600)), params)


def test_a_prefill_only_request_reports_its_prompt(make_engine, tiny):
    llm = _llm(make_engine(tiny))
    prompt = list(range(100, 137))
    out = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.outputs[0].token_ids == []
    assert (out.kv_stats.num_tokens, out.kv_stats.tokens_kept) == (37, 37)


def test_prompts_and_stops_may_be_any_collection(make_engine, tiny):
    llm = _llm(make_engine(tiny))
    params = SamplingParams(max_tokens=3, temperature=0.0, stop={"zzz"}, stop_token_ids=range(2))
    outputs = llm.generate((p for p in ["one prompt", "another one"]), params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]


def test_speculation_does_not_change_the_usage_past_a_stop(make_engine, smollm2_checkpoint):
    # A stop inside an accepted draft: the verification step also wrote the draft tokens past
    # it, which are no part of the request's usage.
    engine = make_engine(
        smollm2_checkpoint,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
    )
    llm = _llm(engine)
    doc = "The pass key is 48213. " + "The grass is green. The sky is blue. " * 30
    doc += "What is the pass key? The pass key is"
    stats = {}
    for spec in (None, {"method": None}):
        params = SamplingParams(max_tokens=20, temperature=0.0, stop=["."], speculative=spec)
        out = llm.generate(doc, params)[0]
        expected = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        assert out.kv_stats.num_tokens == expected
        assert out.kv_stats.tokens_kept == expected  # a full cache
        stats[spec is None] = (out.outputs[0].text, out.kv_stats.num_tokens)
    assert stats[True] == stats[False]


def test_a_stop_token_id_ends_the_sample_there(make_engine, tiny):
    llm = _llm(make_engine(tiny))
    free = llm.generate("hello there", SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    stop_id = free.token_ids[2]
    first = free.token_ids.index(stop_id)  # the first time it comes
    # listed many times over, as a client may: the sample still stops at its first occurrence
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_id] * 10_000)
    out = llm.generate("hello there", params)[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
