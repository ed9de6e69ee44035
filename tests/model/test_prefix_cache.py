"""Prefix caching inside the engine, fp32: greedy outputs equal with the cache on and
off, hits skip compute with and without compression, aborts and stop strings leave the cache
clean, and cached pages are evicted before running requests are preempted.

Tiny random Llama models (fast) and a few checks on the real SmolLM2-135M.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparsekv.config import CompressionConfig
from sparsekv.engine.prompts import render_chat
from sparsekv.kv_cache.prefix_cache import page_digests
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_checkpoint, tiny_llama_config

GREEDY = dict(temperature=0.0, ignore_eos=True)
SNAPKV = CompressionConfig(method="snapkv", budget=24, window=4, full_layers=1)


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    return tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=1)[0]


def tokens_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (length,), generator=generator).tolist()


def greedy(engine, prompts: dict[str, list[int]], max_tokens=16, policy=None) -> dict:
    """Run ``prompts`` (id -> token ids) together; return id -> output token ids."""
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    done = run_to_completion(engine, [(rid, p, params, policy) for rid, p in prompts.items()])
    return {rid: done[rid].outputs[0].token_ids for rid in prompts}


def cold(make_engine, checkpoint, prompts, **kw) -> dict:
    """Each prompt alone on a fresh engine with the prefix cache off."""
    max_tokens, policy = kw.pop("max_tokens", 16), kw.pop("policy", None)
    return {
        rid: greedy(
            make_engine(checkpoint, prefix_caching=False, **kw), {rid: p}, max_tokens, policy
        )[rid]
        for rid, p in prompts.items()
    }


def cached_content(engine) -> dict[bytes, torch.Tensor]:
    """Digest -> copy of the K/V of every page of the group (all layers)."""
    pool = engine.kv.storages[0].tensors[0]
    return {g.digest: pool[g.pages].clone() for g in engine.kv.prefix_cache.groups()}


def assert_unchanged(engine, before: dict[bytes, torch.Tensor]) -> None:
    after = cached_content(engine)
    for digest, content in before.items():
        if digest in after:
            assert torch.equal(after[digest], content)


# ----------------------------------------------------------------- exact prefix caching
@pytest.mark.parametrize(
    "case, warm_len, query, expected_hit",
    [
        ("prompt-1", 41, lambda t: t[:41], 40),  # the hit is the prompt minus its last token
        ("whole-prompt", 40, lambda t: t[:40], 32),  # the last page holds the last token
        ("page-boundary", 50, lambda t: t[:24] + tokens_of(20, 9), 24),
    ],
)
def test_hit_lengths_equal_cold_run(tiny, make_engine, case, warm_len, query, expected_hit):
    base = tokens_of(60, 1)
    prompts = {"warm": base[:warm_len], "query": query(base)}
    engine = make_engine(tiny, block_size=8)
    got = greedy(engine, {"warm": prompts["warm"]})
    got |= greedy(engine, {"query": prompts["query"]})
    assert engine.stats.num_prefix_cache_queries == 2
    assert engine.stats.num_prefix_cache_hits == 1
    assert engine.stats.num_prefix_cache_hit_tokens == expected_hit
    assert got == cold(make_engine, tiny, prompts, block_size=8)


def test_multi_turn_reuses_the_previous_turn(tiny, make_engine):
    turn1 = tokens_of(30, 2)
    engine = make_engine(tiny, block_size=8)
    answer = greedy(engine, {"t1": turn1})["t1"]
    turn2 = turn1 + answer + tokens_of(10, 3)  # turn 2's prompt starts with turn 1 + answer
    got = greedy(engine, {"t2": turn2})
    # Turn 1 computed its prompt and 15 of its 16 answer tokens: 5 full pages.
    assert engine.stats.num_prefix_cache_hit_tokens == 40 > len(turn1)
    assert got == cold(make_engine, tiny, {"t2": turn2}, block_size=8)


def test_shared_prefix_batch_equals_one_by_one(tiny, make_engine):
    prefix = tokens_of(40, 4)
    prompts = {f"r{i}": prefix + tokens_of(3 + 5 * i, 10 + i) for i in range(4)}
    engine = make_engine(tiny, block_size=8)
    greedy(engine, {"warm": prefix + [7, 7, 7]})
    got = greedy(engine, prompts)  # four running requests share the same cached pages
    assert engine.stats.num_prefix_cache_hits == 4
    assert engine.stats.num_prefix_cache_hit_tokens == 4 * 40
    assert got == cold(make_engine, tiny, prompts, block_size=8)


@pytest.mark.parametrize("policy", [None, CompressionConfig(method="snapkv", scope="context")])
def test_samples_of_one_request_share_one_prefill(tiny, make_engine, policy):
    """n = 3: samples 2 and 3 wait for sample 1's prefill, then take its prompt pages (or its
    compressed context) from the cache: one prefill for the three, outputs as n = 1's."""
    prompt = tokens_of(200, 5)
    if policy is not None:
        policy = dataclasses.replace(policy, budget=24, window=4, context_tokens=180)
    engine = make_engine(tiny)
    params = SamplingParams(n=3, max_tokens=8, **GREEDY)
    done = run_to_completion(engine, [("r", prompt, params, policy)])
    alone = cold(make_engine, tiny, {"s": prompt}, max_tokens=8, policy=policy)["s"]
    assert [o.token_ids for o in done["r"].outputs] == [alone] * 3
    # Full cache: 12 whole pages of the 199 tokens before the last; context: its 180 tokens.
    assert engine.stats.num_prefix_cache_hit_tokens == 2 * (192 if policy is None else 180)
    assert engine.stats.num_prompt_tokens == 200  # once per request, as usage counts it


@pytest.mark.parametrize(
    ("extra", "policy", "uncompressed"),
    [
        (dict(prompt_logprobs=0), None, False),  # every prompt row must run
        ({}, CompressionConfig(method="h2o", budget=24, window=4), True),  # no hit: H2O mass
        ({}, SNAPKV, False),  # compressed pages never enter the cache
    ],
)
def test_samples_without_a_shareable_prefill_prefill_each(
    tiny, make_engine, extra, policy, uncompressed
):
    """Where the other samples could get no hit, none waits for the first's prefill."""
    engine = make_engine(tiny, prefix_cache_uncompressed=uncompressed)
    params = SamplingParams(n=2, max_tokens=4, **extra, **GREEDY)
    engine.add_request("r", tokens_of(100, 6), params, policy)
    assert [r.prefill_leader for r in engine.scheduler.waiting] == [None, None]
    engine.step()
    assert engine.scheduler.num_running == 2  # both admitted in the first step
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.num_prefix_cache_hit_tokens == 0


# ----------------------------------------------------------------- with compression
def run_stepwise(engine, request_id, prompt, policy, max_tokens=16, after_first_step=None):
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    engine.add_request(request_id, prompt, params, policy)
    request = engine.scheduler.waiting[-1]
    engine.step()
    if after_first_step is not None:
        after_first_step(request)
    while engine.has_unfinished_requests():
        engine.step()
    return request.output_token_ids


@pytest.mark.parametrize("shared", [64, 80])  # a divergent suffix, or the same prompt
def test_uncompressed_prefix_with_compression_equals_cold_run(tiny, make_engine, shared):
    base = tokens_of(80, 5)
    prompts = {"a": base, "b": base[:shared] + tokens_of(84 - shared, 6)}
    engine = make_engine(tiny, block_size=4, prefix_cache_uncompressed=True)
    got = {"a": run_stepwise(engine, "a", prompts["a"], SNAPKV)}
    # Every layer's uncompressed prompt pages are cached; a's budgeted layers hold 24 slots.
    assert engine.kv.prefix_cache.num_groups == 20
    snapshot = cached_content(engine)
    cached_pages = {p for g in engine.kv.prefix_cache.groups() for p in g.pages}

    def check_copy_on_write(request):
        layers = engine.kv.get(request.request_id).layers
        hit = engine.stats.num_prefix_cache_hit_tokens
        assert layers[0].block_table[: hit // 4] == engine.kv.prefix_cache.pages_of(
            page_digests(prompts["b"][:hit], 4), 0
        )
        for state in layers[1:]:  # compacted into fresh pages, never into cached ones
            assert state.num_held == 24 and not set(state.block_table) & cached_pages

    got["b"] = run_stepwise(engine, "b", prompts["b"], SNAPKV, after_first_step=check_copy_on_write)
    assert engine.stats.num_prefix_cache_hit_tokens == min(shared, 84 - 4)
    assert_unchanged(engine, snapshot)
    assert got == cold(make_engine, tiny, prompts, block_size=4, policy=SNAPKV)


def test_without_the_option_compressed_prompts_are_not_cached(tiny, make_engine):
    engine = make_engine(tiny, block_size=4)
    greedy(engine, {"a": tokens_of(80, 5)}, policy=SNAPKV)
    assert engine.kv.prefix_cache.num_groups == 0


def test_decode_eviction_after_a_hit_copies_on_write(tiny, make_engine):
    policy = CompressionConfig(method="snapkv", budget=40, window=4, full_layers=1)
    base = tokens_of(30, 7)
    prompts = {"a": base, "b": base[:24] + tokens_of(6, 8)}
    engine = make_engine(tiny, block_size=8)
    got = greedy(engine, {"a": prompts["a"]}, max_tokens=40, policy=policy)
    snapshot = cached_content(engine)
    got |= greedy(engine, {"b": prompts["b"]}, max_tokens=40, policy=policy)
    assert engine.stats.num_prefix_cache_hit_tokens == 24  # capped at 30 - window
    assert engine.stats.num_evicted_tokens > 0
    assert_unchanged(engine, snapshot)
    assert got == cold(make_engine, tiny, prompts, block_size=8, max_tokens=40, policy=policy)


def test_h2o_requests_that_may_compact_get_no_hit(tiny, make_engine):
    policy = CompressionConfig(method="h2o", budget=40, window=4, full_layers=1)
    engine = make_engine(tiny, block_size=8)
    prompt = tokens_of(30, 7)
    greedy(engine, {"warm": prompt})
    greedy(engine, {"h2o": prompt}, max_tokens=24, policy=policy)  # 30 + 24 >= 40 + 8
    assert engine.stats.num_prefix_cache_queries == 2
    assert engine.stats.num_prefix_cache_hits == 0


def test_budgeted_request_that_never_compacts_hits_like_a_full_cache(tiny, make_engine):
    # The server's default policy (budget 1024) never touches a short chat: no window recompute.
    policy = CompressionConfig(method="snapkv", budget=1024, window=32)
    prompts = {"warm": tokens_of(41, 14), "query": tokens_of(41, 14)}
    engine = make_engine(tiny, block_size=8)
    got = greedy(engine, {"warm": prompts["warm"]}, policy=policy)
    got |= greedy(engine, {"query": prompts["query"]}, policy=policy)
    assert engine.stats.num_prefix_cache_hit_tokens == 40
    assert got == cold(make_engine, tiny, prompts, block_size=8, policy=policy)


# ----------------------------------------------------------------- aborts and stop strings
def test_abort_changes_no_cached_content_or_other_outputs(tiny, make_engine):
    base = tokens_of(48, 11)
    prompts = {"x": base[:40] + tokens_of(8, 12), "y": base[:40] + tokens_of(9, 13)}
    engine = make_engine(tiny, block_size=8)
    greedy(engine, {"warm": base})
    snapshot = cached_content(engine)
    params = SamplingParams(max_tokens=24, **GREEDY)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    x = engine.scheduler.waiting[0]
    for _ in range(12):  # x computes its prompt and 11 generated tokens (a full page: 48..55)
        engine.step()
    engine.abort_request("x")
    y_out = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            y_out = output.outputs[0].token_ids
    assert engine.stats.num_prefix_cache_hits == 2
    assert_unchanged(engine, snapshot)
    # The aborted request's generated tokens never enter the cache.
    x_digests = page_digests(x.prompt_token_ids + x.output_token_ids, 8)
    assert len(x_digests) == 7 and x_digests[5] in engine.kv.prefix_cache  # prompt pages
    assert x_digests[6] not in engine.kv.prefix_cache
    expected = cold(make_engine, tiny, {"y": prompts["y"]}, block_size=8, max_tokens=24)
    assert y_out == expected["y"]


def test_stop_string_leaves_no_cached_page_past_the_stop(tiny, make_engine, smollm2_tokenizer):
    tokenizer, prompt = smollm2_tokenizer, tokens_of(13, 0)
    free_run = greedy(make_engine(tiny, block_size=4, prefix_caching=False), {"a": prompt}, 30)
    out = free_run["a"]
    pieces = [tokenizer.decode(out[: k + 1])[len(tokenizer.decode(out[:k])) :] for k in range(18)]
    # A stop string from the middle of output token 14 to the middle of token 16.
    stop = pieces[14][-3:] + pieces[15] + pieces[16][:2]
    assert stop not in tokenizer.decode(out[:14]) and len(pieces[14]) > 3
    engine = make_engine(tiny, block_size=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    final = run_to_completion(engine, [("s", prompt, params)])["s"].outputs[0]
    assert final.stop_reason == stop and final.token_ids == out[:17]
    text, num_prompt = final.text, len(prompt)
    digests = page_digests(prompt + out[:17], 4)
    cached = [j for j, d in enumerate(digests) if d in engine.kv.prefix_cache]
    assert cached == list(range(len(cached))) and len(cached) * 4 > num_prompt
    for j in cached:  # each cached page's output tokens lie before the stop
        assert text.startswith(tokenizer.decode(out[: max(0, (j + 1) * 4 - num_prompt)]))
    # Tokens 12..15 of the output (page 6) reach past the stop's start: computed, not cached.
    assert 6 not in cached and len(digests) > 6


# ----------------------------------------------------------------- memory pressure
def test_cached_pages_are_evicted_before_running_requests_are_preempted(tiny, make_engine):
    engine = make_engine(tiny, block_size=4, num_pages=120)
    for i in range(6):  # each leaves 6 cached groups (18 pages) behind
        greedy(engine, {f"fill{i}": tokens_of(20, 20 + i)}, max_tokens=8)
    num_cached_before = engine.kv.prefix_cache.num_groups
    assert engine.kv.pool.num_free_pages < 90 <= engine.kv.num_free_pages
    prompts = {f"r{i}": tokens_of(40, 30 + i) for i in range(2)}  # 2 x 45 pages at the peak
    params = SamplingParams(max_tokens=20, **GREEDY)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    got = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                got[output.request_id] = output.outputs[0].token_ids
        engine.kv.check_invariants()
    assert engine.stats.num_preemptions == 0
    assert engine.kv.prefix_cache.num_groups < num_cached_before + 2 * 14
    assert got == cold(make_engine, tiny, prompts, block_size=4, max_tokens=20)


# ----------------------------------------------------------------- real SmolLM2
def test_smollm2_chat_turn_two_hits_turn_one(smollm2_checkpoint, make_engine, smollm2_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France? One sentence."}]
    turn1 = render_chat(smollm2_tokenizer, messages)
    engine = make_engine(smollm2_checkpoint, block_size=4)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    answer = run_to_completion(engine, [("t1", turn1, params)])["t1"].outputs[0].text
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Germany?"},
    ]
    turn2 = render_chat(smollm2_tokenizer, messages)
    got = run_to_completion(engine, [("t2", turn2, params)])["t2"].outputs[0].token_ids
    assert engine.stats.num_prefix_cache_hit_tokens > len(turn1)
    cold_engine = make_engine(smollm2_checkpoint, block_size=4, prefix_caching=False)
    assert got == run_to_completion(cold_engine, [("t2", turn2, params)])["t2"].outputs[0].token_ids


def test_smollm2_compressed_hit_equals_cold_run(smollm2_checkpoint, make_engine, smollm2_tokenizer):
    policy = CompressionConfig(method="snapkv", budget=64, window=8)
    text = "The history of the printing press begins with movable type. " * 20
    document = smollm2_tokenizer(text)["input_ids"][:144]
    questions = [
        " Who invented the printing press, and when?",
        " Where did it spread first, and how?",
    ]
    prompts = {
        f"q{i}": document + smollm2_tokenizer(q)["input_ids"] for i, q in enumerate(questions)
    }
    assert all(len(p) >= 144 + policy.window for p in prompts.values())
    engine = make_engine(smollm2_checkpoint, prefix_cache_uncompressed=True)
    greedy(engine, {"q0": prompts["q0"]}, max_tokens=8, policy=policy)
    got = greedy(engine, {"q1": prompts["q1"]}, max_tokens=8, policy=policy)
    assert engine.stats.num_prefix_cache_hit_tokens == 144  # the whole document (9 pages)
    expected = cold(
        make_engine, smollm2_checkpoint, {"q1": prompts["q1"]}, max_tokens=8, policy=policy
    )
    assert got == expected
