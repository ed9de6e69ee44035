"""Adaptive head budgets in the engine: head-wise pages, real savings, the dense oracle.

A request compressed with ``head_budgets="adaptive"`` keeps per KV head the slots the dense
reference picks (Ada-KV by brute force, ``dense_reference.py``), decodes to the reference's
logits over those unequal per-head sets, and holds exactly the pages the head-wise layout
claims (``kv_cache.head_pages``).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.compression.base import Compressor
from sparsekv.config import CompressionConfig
from sparsekv.kv_cache.spec import cdiv
from sparsekv.sampling_params import SamplingParams
from tests.conftest import record_selections, tiny_checkpoint, tiny_llama_config
from tests.model.dense_reference import DenseMaskedAttention

GREEDY = dict(temperature=0.0, ignore_eos=True)
BUDGET, WINDOW, BLOCK = 24, 4, 4


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    config = tiny_llama_config(num_heads=6, num_kv_heads=3, num_layers=4, hidden_size=96)
    return tiny_checkpoint(config, smollm2_tokenizer, seed=11)


def policy(**overrides):
    settings = dict(
        method="snapkv",
        budget=BUDGET,
        window=WINDOW,
        full_layers=1,
        kernel_size=3,
        head_budgets="adaptive",
    )
    settings.update(overrides)
    return CompressionConfig(**settings)


def prompt_of(length, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (length,), generator=generator).tolist()


def start(engine, prompt, max_tokens, settings, request_id="q"):
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    engine.add_request(request_id, prompt, params, settings, collect_logits=True)
    return engine.scheduler.waiting[-1]


def finish(engine):
    while engine.has_unfinished_requests():
        engine.step()


def reference_logits(model, prompt, tokens, reference):
    logits = []
    with torch.inference_mode():
        sequence = prompt + tokens
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), reference)
        logits.append(model.compute_logits(hidden[-1:])[0])
        for position in range(len(prompt), len(sequence) - 1):
            token = torch.tensor([sequence[position]])
            hidden = model(token, torch.tensor([position]), reference)
            logits.append(model.compute_logits(hidden)[0])
    return torch.stack(logits)


def test_adaptive_decode_equals_masked_dense_reference(tiny, make_engine):
    checkpoint, _ = tiny
    engine = make_engine(checkpoint, block_size=BLOCK)
    prompt = prompt_of(70, seed=1)
    request = start(engine, prompt, 40, policy())
    engine.step()  # the prefill, compressed at its end
    kv = engine.kv.get("q")
    after_prefill = [list(layer.head_lens) for layer in kv.layers[1:]]
    finish(engine)

    reference = DenseMaskedAttention(
        4, [None] + [BUDGET] * 3, WINDOW, BLOCK, len(prompt), kernel_size=3,
        head_budgets="adaptive",
    )  # fmt: skip
    expected = reference_logits(engine.parts.model, prompt, request.output_token_ids, reference)
    torch.testing.assert_close(torch.stack(request.logits), expected, atol=1e-3, rtol=0)
    decoded = len(request.output_token_ids) - 1  # the last sampled token is never fed back
    for layer, lens in enumerate(after_prefill, start=1):
        positions = reference.kept_positions(layer)
        assert lens == [len(p) - decoded for p in positions]
        assert sum(lens) == 3 * BUDGET
    # The budget moved between heads somewhere (random weights: the heads are not alike).
    assert any(len(set(lens)) > 1 for lens in after_prefill)


def test_pages_held_equal_the_head_wise_layout(tiny, make_engine):
    checkpoint, _ = tiny
    engine = make_engine(checkpoint, block_size=BLOCK, prefix_caching=False)
    free_before = engine.kv.num_free_pages
    prompt = prompt_of(90, seed=2)
    start(engine, prompt, 30, policy())
    per_page = 3 * BLOCK  # one head's slots per page
    for _ in range(20):
        engine.step()
        kv = engine.kv.get("q")
        held = 0
        for layer, state in enumerate(kv.layers):
            if layer == 0:
                assert state.head_lens is None
                assert len(state.block_table) == cdiv(state.num_held, BLOCK)
            else:
                assert state.head_pages == [cdiv(n, per_page) for n in state.head_lens]
                assert len(state.block_table) == sum(state.head_pages)
                assert state.num_held == cdiv(sum(state.head_lens), 3)
            held += len(state.block_table)
        # Plus the pages standing for the stored window queries (kv_cache.side_state).
        assert len(kv.side_pages) == engine.scheduler.running[0].policy.kv.side_pages > 0
        assert free_before - engine.kv.num_free_pages == held + len(kv.side_pages)
    finish(engine)
    assert engine.kv.num_free_pages == free_before


def test_adaptive_holds_no_more_than_flat_plus_a_page_per_head(tiny, make_engine):
    checkpoint, _ = tiny
    prompt = prompt_of(200, seed=3)
    held = {}
    for head_budgets in ("flat", "adaptive"):
        engine = make_engine(checkpoint, block_size=BLOCK, prefix_caching=False)
        settings = policy(head_budgets=head_budgets, budget=48, decode_eviction=False)
        start(engine, prompt, 8, settings)
        engine.step()
        held[head_budgets] = [len(s.block_table) for s in engine.kv.get("q").layers]
        finish(engine)
    assert held["flat"] == [cdiv(200, BLOCK)] + [48 // BLOCK] * 3
    full_layer, *budgeted = held["adaptive"]
    assert full_layer == held["flat"][0]
    assert all(48 // BLOCK <= pages <= 48 // BLOCK + 2 for pages in budgeted)


def test_a_layer_the_prompt_fits_keeps_decode_eviction(tiny, make_engine):
    # Nothing overflows at prefill: every layer stays flat, evicts during decode like the flat
    # policy, and the request equals the flat one token for token and page for page.
    checkpoint, _ = tiny
    prompt = prompt_of(16, seed=6)
    runs = {}
    for head_budgets in ("flat", "adaptive"):
        engine = make_engine(checkpoint, block_size=BLOCK, prefix_caching=False)
        request = start(engine, prompt, 40, policy(head_budgets=head_budgets))
        for _ in range(30):
            engine.step()
        layers = engine.kv.get("q").layers
        held = [(len(s.block_table), s.num_held, s.head_lens) for s in layers]
        finish(engine)
        runs[head_budgets] = (request.output_token_ids, held)
    assert runs["adaptive"] == runs["flat"]
    _, held = runs["adaptive"]
    assert held[0][1] == 16 + 29  # the full layer
    assert all(num_held <= BUDGET + BLOCK and heads is None for _, num_held, heads in held[1:])


def test_split_and_flat_layers_of_one_request(tiny, make_engine):
    # Layers 1 and 3 (budget 16) split at prefill and grow head by head; layer 2 (budget 48)
    # holds the whole 30-token prompt flat and evicts at 48 + BLOCK slots.
    checkpoint, _ = tiny
    engine = make_engine(checkpoint, block_size=BLOCK, prefix_caching=False)
    free_before = engine.kv.num_free_pages
    settings = policy(layer_budgets=(0, 16, 48, 16))
    start(engine, prompt_of(30, seed=7), 40, settings)
    engine.step()  # the prefill
    for decoded in range(1, 40):
        layers = engine.kv.get("q").layers
        for layer in (1, 3):
            assert sum(layers[layer].head_lens) == 3 * (16 + decoded - 1)
        assert layers[2].head_lens is None
        assert layers[2].num_held <= 48 + BLOCK
        assert len(layers[2].block_table) == cdiv(layers[2].num_held, BLOCK)
        if decoded == 39:
            assert layers[2].num_held < 30 + decoded - 1  # evicted
        engine.step()
    finish(engine)
    assert engine.kv.num_free_pages == free_before


def test_adaptive_batch_equals_alone_and_survives_preemption(tiny, make_engine):
    checkpoint, _ = tiny
    prompts = [prompt_of(n, seed=20 + n) for n in (70, 40, 55)]
    alone = []
    for prompt in prompts:
        engine = make_engine(checkpoint, block_size=BLOCK)
        request = start(engine, prompt, 25, policy())
        finish(engine)
        alone.append(request.output_token_ids)
    # A pool too small for all three at once: requests are swapped out and back in.
    engine = make_engine(checkpoint, block_size=BLOCK, num_pages=110)
    requests = [start(engine, p, 25, policy(), f"r{i}") for i, p in enumerate(prompts)]
    finish(engine)
    assert [r.output_token_ids for r in requests] == alone
    assert engine.stats.num_preemptions > 0


def test_question_after_compressed_context_equals_the_reference(tiny, make_engine):
    # Scope context: the context is compressed head-wise at its end, then the question's chunk
    # attends every head's pages (one call per KV head) and is appended to every head.
    checkpoint, _ = tiny
    context, question = prompt_of(80, seed=4), prompt_of(12, seed=5)
    engine = make_engine(checkpoint, block_size=BLOCK, prefix_caching=False)
    request = start(engine, context + question, 10, policy(scope="context", context_tokens=80))
    finish(engine)
    reference = DenseMaskedAttention(
        4, [None] + [BUDGET] * 3, WINDOW, BLOCK, len(context), kernel_size=3,
        head_budgets="adaptive",
    )  # fmt: skip
    model, tokens = engine.parts.model, request.output_token_ids
    with torch.inference_mode():
        model(torch.tensor(context), torch.arange(80), reference)
        hidden = model(torch.tensor(question), torch.arange(80, 92), reference)
        logits = [model.compute_logits(hidden[-1:])[0]]
        for position, token in enumerate(tokens[:-1], start=92):
            hidden = model(torch.tensor([token]), torch.tensor([position]), reference)
            logits.append(model.compute_logits(hidden)[0])
    torch.testing.assert_close(torch.stack(request.logits), torch.stack(logits), atol=1e-3, rtol=0)


def test_settings_head_wise_pages_cannot_serve_are_rejected(tiny, make_engine):
    checkpoint, _ = tiny
    engine = make_engine(checkpoint, block_size=BLOCK)
    params = SamplingParams(max_tokens=4, **GREEDY)
    with pytest.raises(ValueError, match="kv_compression.head_budgets: h2o"):
        engine.add_request("a", prompt_of(40, 8), params, policy(method="h2o"))
    speculative = SamplingParams(max_tokens=4, speculative={"method": "ngram"}, **GREEDY)
    with pytest.raises(ValueError, match="head_budgets.*speculative"):
        engine.add_request("b", prompt_of(40, 8), speculative, policy())
    assert not engine.has_unfinished_requests()


def test_prefix_hit_compacts_head_wise_into_fresh_pages(tiny, make_engine):
    # The second request shares the first one's cached uncompressed prompt pages: its
    # compaction goes copy-on-write into fresh pages, slack included, and decodes the same.
    checkpoint, _ = tiny
    prompt = prompt_of(64, seed=6) + prompt_of(9, seed=7)
    alone_engine = make_engine(checkpoint, block_size=BLOCK, prefix_caching=False)
    alone = start(alone_engine, prompt, 12, policy())
    finish(alone_engine)
    engine = make_engine(checkpoint, block_size=BLOCK, prefix_cache_uncompressed=True)
    first = start(engine, prompt, 12, policy(), "a")
    finish(engine)
    second = start(engine, prompt, 12, policy(), "b")
    finish(engine)
    assert engine.stats.num_prefix_cache_hit_tokens > 0
    assert first.output_token_ids == alone.output_token_ids
    assert second.output_token_ids == alone.output_token_ids
    torch.testing.assert_close(torch.stack(second.logits), torch.stack(alone.logits))


def test_one_kv_head_keeps_the_flat_policy(smollm2_tokenizer, make_engine):
    # One KV head has nothing to share: adaptive is the flat layout, decode-time eviction
    # included (the output passes budget + block_size several times).
    config = tiny_llama_config(num_heads=4, num_kv_heads=1, num_layers=3)
    checkpoint, _ = tiny_checkpoint(config, smollm2_tokenizer, seed=5)
    prompt = prompt_of(60, seed=9)
    outputs = []
    for head_budgets in ("flat", "adaptive"):
        engine = make_engine(checkpoint, block_size=BLOCK)
        request = start(engine, prompt, 40, policy(head_budgets=head_budgets))
        finish(engine)
        outputs.append((request.output_token_ids, torch.stack(request.logits)))
    assert outputs[0][0] == outputs[1][0]
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_engine_default_h2o_with_adaptive_fails_at_start(tiny, make_engine):
    checkpoint, _ = tiny
    with pytest.raises(ValueError, match="kv_compression.head_budgets: h2o accumulates"):
        make_engine(checkpoint, compression=policy(method="h2o"))


def test_a_request_turning_speculation_off_may_use_adaptive(tiny, make_engine):
    from sparsekv.config import SpeculativeConfig

    checkpoint, _ = tiny
    engine = make_engine(
        checkpoint, block_size=BLOCK, speculative=SpeculativeConfig(method="ngram")
    )
    plain = SamplingParams(max_tokens=6, speculative={"method": None}, **GREEDY)
    engine.add_request("a", prompt_of(60, 12), plain, policy())
    finish(engine)
    with pytest.raises(ValueError, match="head_budgets.*speculative_method"):
        engine.add_request("b", prompt_of(60, 12), SamplingParams(max_tokens=6, **GREEDY),
                           policy())  # fmt: skip


def test_first_layer_scores_rank_every_budgeted_layer(tiny, make_engine, monkeypatch):
    # layer_scores="first": the first budgeted layer's own head-wise selection is what every
    # later budgeted layer (same budget) keeps; with "own" the later layers keep other slots.
    checkpoint, _ = tiny
    chosen = record_selections(monkeypatch, Compressor, "select_heads")
    runs = {}
    for layer_scores in ("own", "first"):
        chosen.clear()
        engine = make_engine(checkpoint, block_size=BLOCK)
        start(engine, prompt_of(70, seed=1), 2, policy(layer_scores=layer_scores))
        finish(engine)
        runs[layer_scores] = list(chosen)
    own, first = runs["own"], runs["first"]
    assert len(own) == len(first) == 3  # layers 1-3, once each at the prompt's end
    assert first == [own[0]] * 3
    assert own[1:] != [own[0]] * 2
