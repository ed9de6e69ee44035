"""Context reuse: ``kv_compression.scope = "context"`` compresses a shared
context once; later requests with the same context and policy attach it read-only and append
their own questions uncompressed (the kvpress pattern). fp32, tiny random Llama, one check of
the chat context on SmolLM2's template.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import CompressionConfig
from sparsekv.engine.prompts import chat_context_tokens, render_chat
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_checkpoint, tiny_llama_config

GREEDY = dict(temperature=0.0, ignore_eos=True)
CONTEXT = 100


def policy(**kw) -> CompressionConfig:
    values = dict(method="snapkv", budget=40, window=4, full_layers=1, scope="context")
    values.update(kw)
    return CompressionConfig(context_tokens=CONTEXT, **values)


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    return tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=5)[0]


def tokens_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (length,), generator=generator).tolist()


DOCUMENT = tokens_of(CONTEXT, 1)
QUESTIONS = [tokens_of(n, 10 + i) for i, n in enumerate([12, 20, 7])]


def run(engine, prompts: dict[str, list[int]], compression, max_tokens=12) -> dict:
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    items = [(rid, p, params, compression) for rid, p in prompts.items()]
    return run_to_completion(engine, items)


def ids(outputs) -> dict:
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items()}


def cold(make_engine, tiny, prompts, compression, **kw) -> dict:
    """Each prompt alone on a fresh engine without any cache."""
    return {
        rid: ids(run(make_engine(tiny, prefix_caching=False, **kw), {rid: p}, compression))[rid]
        for rid, p in prompts.items()
    }


@pytest.mark.parametrize("fmt", ["auto", "int8", "int4"])
def test_later_questions_attach_the_compressed_context(tiny, make_engine, fmt):
    prompts = {f"q{i}": DOCUMENT + q for i, q in enumerate(QUESTIONS)}
    engine = make_engine(tiny, kv_cache_dtype=fmt)
    first = ids(run(engine, {"q0": prompts["q0"]}, policy()))
    assert engine.stats.num_prefix_cache_hits == 0
    later = ids(run(engine, {k: v for k, v in prompts.items() if k != "q0"}, policy()))
    assert engine.stats.num_prefix_cache_hits == 2
    assert engine.stats.num_prefix_cache_hit_tokens == 2 * CONTEXT
    assert first | later == cold(make_engine, tiny, prompts, policy(), kv_cache_dtype=fmt)


@pytest.mark.parametrize("method", ["snapkv", "expected_attention", "kvzip"])
def test_only_the_context_is_compressed(tiny, make_engine, method):
    prompt = DOCUMENT + QUESTIONS[1]
    out = run(make_engine(tiny), {"a": prompt}, policy(method=method), max_tokens=12)["a"]
    kept = out.kv_stats.kept_per_layer
    # Full layer: everything; budgeted layers: the budget, then question and output whole
    # (no decode-time eviction), the last output token's K/V never computed.
    assert kept == [len(prompt) + 11, 40 + 20 + 11, 40 + 20 + 11]
    assert out.kv_stats.evicted_per_layer == [0, CONTEXT - 40, CONTEXT - 40]


def test_a_batch_sharing_a_context_equals_one_by_one(tiny, make_engine):
    prompts = {f"q{i}": DOCUMENT + q for i, q in enumerate(QUESTIONS)}
    together = ids(run(make_engine(tiny), prompts, policy()))
    assert together == cold(make_engine, tiny, prompts, policy())


@pytest.mark.parametrize(
    "other",
    [
        policy(budget=48),  # another budget
        policy(window=8),  # another scoring window
        CompressionConfig(method="snapkv", budget=40, window=4, full_layers=1),  # scope prompt
    ],
)
def test_no_hit_across_policies(tiny, make_engine, other):
    engine = make_engine(tiny)
    run(engine, {"a": DOCUMENT + QUESTIONS[0]}, policy())
    run(engine, {"b": DOCUMENT + QUESTIONS[1]}, other)
    assert engine.stats.num_prefix_cache_hits == 0


def test_no_hit_for_another_context(tiny, make_engine):
    engine = make_engine(tiny)
    run(engine, {"a": DOCUMENT + QUESTIONS[0]}, policy())
    changed = DOCUMENT[:-1] + [DOCUMENT[-1] + 1] + QUESTIONS[1]
    run(engine, {"b": changed}, policy())
    assert engine.stats.num_prefix_cache_hits == 0


def cached_contexts(engine) -> dict:
    pool = engine.kv.storages[0].tensors[0]
    return {g.digest: pool[g.pages].clone() for g in engine.kv.prefix_cache.groups()}


def test_abort_keeps_the_cached_context(tiny, make_engine):
    engine = make_engine(tiny)
    run(engine, {"a": DOCUMENT + QUESTIONS[0]}, policy())
    before = cached_contexts(engine)
    assert len(before) == 1
    params = SamplingParams(max_tokens=30, **GREEDY)
    engine.add_request("b", DOCUMENT + QUESTIONS[1], params, policy())
    for _ in range(3):
        engine.step()
    engine.abort_request("b")
    after = cached_contexts(engine)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    expected = cold(make_engine, tiny, {"c": DOCUMENT + QUESTIONS[2]}, policy())
    assert ids(run(engine, {"c": DOCUMENT + QUESTIONS[2]}, policy())) == expected


def test_cached_contexts_are_evicted_before_preemption(tiny, make_engine):
    # A cached context holds 6 + 2 + 2 full pages (layer 0 full, 100 and 40 slots of 16); a
    # running request needs about 16 more: 60 pages hold five contexts at most.
    engine = make_engine(tiny, num_pages=60)
    documents = [tokens_of(CONTEXT, 50 + i) for i in range(7)]
    for i, document in enumerate(documents):  # one after another
        run(engine, {f"d{i}": document + QUESTIONS[0]}, policy())
    assert engine.stats.num_preemptions == 0
    assert engine.kv.prefix_cache.num_groups < 7  # the oldest were evicted for the newer
    run(engine, {"again": documents[-1] + QUESTIONS[1]}, policy())
    assert engine.stats.num_prefix_cache_hits == 1  # the newest is still there


def test_context_validation(tiny, make_engine):
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=4, **GREEDY)
    no_length = CompressionConfig(method="snapkv", budget=40, scope="context")
    with pytest.raises(ValueError, match="context_tokens"):
        engine.add_request("a", DOCUMENT, params, no_length)
    with pytest.raises(ValueError, match="context_tokens: 100 exceeds"):
        engine.add_request("b", DOCUMENT[:50], params, policy())


def test_chat_context_is_what_precedes_the_last_user_message(smollm2_tokenizer):
    messages = [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": "Document: the sky is green on Tuesdays."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "What colour is the sky on Tuesday?"},
    ]
    prompt = render_chat(smollm2_tokenizer, messages)
    context = chat_context_tokens(smollm2_tokenizer, messages, prompt)
    assert prompt[:context] == render_chat(smollm2_tokenizer, messages[:3], False)
    assert 0 < context < len(prompt)
    assert "What colour" in smollm2_tokenizer.decode(prompt[context:])
    single = messages[-1:]
    assert (
        chat_context_tokens(smollm2_tokenizer, single, render_chat(smollm2_tokenizer, single)) == 0
    )
