"""Layer-wise compression inside the engine (issue: compressors, budgets, real savings).

The key test: a request compressed to budget B and decoded 100 tokens (with decode-time
eviction) gives the same logits as a dense full-cache reference whose attention masks exactly
the evicted tokens per layer and head (``dense_reference.py``, an independent implementation).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import CompressionConfig
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_checkpoint, tiny_llama_config
from tests.model.dense_reference import DenseMaskedAttention

GREEDY = dict(temperature=0.0, ignore_eos=True)
METHODS = [
    "snapkv",
    "pyramidkv",
    "h2o",
    "streaming_llm",
    "tova",
    "knorm",
    "random",
    "expected_attention",
    "kvzip",
]


@pytest.fixture(scope="module", params=["gqa", "mha"])
def tiny(request, smollm2_tokenizer):
    heads = (4, 2) if request.param == "gqa" else (4, 4)
    config = tiny_llama_config(num_heads=heads[0], num_kv_heads=heads[1], num_layers=4)
    return tiny_checkpoint(config, smollm2_tokenizer, seed=7)


def prompt_of(length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (length,), generator=generator).tolist()


def run_one(engine, prompt, max_tokens, policy=None, forced=None):
    engine.add_request(
        "q",
        prompt,
        SamplingParams(max_tokens=max_tokens, **GREEDY),
        policy,
        forced_token_ids=forced,
        collect_logits=True,
    )
    request = engine.scheduler.waiting[-1]
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    return request, final


@pytest.mark.parametrize("pooling", ["max", "none"])
def test_compressed_decode_equals_masked_dense_reference(tiny, make_engine, pooling):
    checkpoint, _ = tiny
    budget, window, block = 24, 4, 4
    policy = CompressionConfig(
        method="snapkv",
        budget=budget,
        window=window,
        full_layers=1,
        pooling=pooling,
        kernel_size=3,
    )
    engine = make_engine(checkpoint, block_size=block)
    prompt = prompt_of(70, seed=1)
    request, final = run_one(engine, prompt, 100, policy)
    tokens = request.output_token_ids
    assert len(tokens) == 100
    # The full layer holds every fed token (the last sampled one is never fed back); each
    # budgeted layer ends between budget and budget + block_size - 1 slots.
    kept = final.kv_stats.kept_per_layer
    assert kept[0] == len(prompt) + 99
    assert all(budget <= k < budget + block for k in kept[1:])

    model = engine.parts.model
    budgets = [None] + [budget] * 3
    reference = DenseMaskedAttention(
        4, budgets, window, block, len(prompt), kernel_size=3, pooling=pooling
    )
    logits = []
    with torch.inference_mode():
        sequence = prompt + tokens
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), reference)
        logits.append(model.compute_logits(hidden[-1:])[0])
        for position in range(len(prompt), len(sequence) - 1):
            hidden = model(torch.tensor([sequence[position]]), torch.tensor([position]), reference)
            logits.append(model.compute_logits(hidden)[0])
    expected = torch.stack(logits)
    ours = torch.stack(request.logits)
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
    for layer in range(1, 4):
        counts = [len(p) for p in reference.kept_positions(layer)]
        assert counts == [kept[layer]] * len(counts)


def test_large_budget_or_zero_ratio_is_bit_identical(tiny, make_engine):
    checkpoint, _ = tiny
    prompt = prompt_of(60, seed=2)
    full_request, _ = run_one(make_engine(checkpoint), prompt, 30)
    for policy in (
        CompressionConfig(method="snapkv", budget=60 + 30, window=4),
        CompressionConfig(method="snapkv", budget=None, compression_ratio=0.0, window=4),
    ):
        request, final = run_one(make_engine(checkpoint), prompt, 30, policy)
        assert request.output_token_ids == full_request.output_token_ids
        assert torch.equal(torch.stack(request.logits), torch.stack(full_request.logits))
        assert sum(final.kv_stats.evicted_per_layer) == 0


@pytest.mark.parametrize("method", METHODS)
def test_every_method_keeps_exactly_the_budget(tiny, make_engine, method):
    checkpoint, _ = tiny
    budget, window = 20, 4
    policy = CompressionConfig(
        method=method, budget=budget, window=window, full_layers=1, decode_eviction=False
    )
    engine = make_engine(checkpoint, block_size=4)
    prompt = prompt_of(50, seed=3)
    request, final = run_one(engine, prompt, 5, policy)
    kept = final.kv_stats.kept_per_layer
    # Without decode eviction the layer holds budget + one slot per decoded token (4 fed back).
    assert kept[0] == 54
    expected = budget if method != "pyramidkv" else None
    if expected is not None:
        assert kept[1:] == [budget + 4] * 3
    assert final.kv_stats.compression_ratio > 0


def test_batch_mixing_policies_equals_alone(tiny, make_engine):
    checkpoint, _ = tiny
    prompts = [prompt_of(n, seed=10 + n) for n in (80, 45, 64, 30)]
    policies = [
        CompressionConfig(method="snapkv", budget=24, window=4, full_layers=1),
        CompressionConfig(method="h2o", budget=20, window=4, full_layers=0),
        CompressionConfig(method="streaming_llm", budget=28, window=4, full_layers=2),
        CompressionConfig(method="none"),
    ]
    params = SamplingParams(max_tokens=40, **GREEDY)
    alone = []
    for i, (prompt, policy) in enumerate(zip(prompts, policies)):
        done = run_to_completion(
            make_engine(checkpoint, block_size=4), [(f"a{i}", prompt, params, policy)]
        )
        alone.append(done[f"a{i}"].outputs[0].token_ids)
    engine = make_engine(checkpoint, block_size=4)
    together = run_to_completion(
        engine, [(f"b{i}", p, params, pol) for i, (p, pol) in enumerate(zip(prompts, policies))]
    )
    assert [together[f"b{i}"].outputs[0].token_ids for i in range(4)] == alone
    # Reusing the engine leaks nothing from one request to the next.
    again = run_to_completion(engine, [("c0", prompts[0], params, policies[0])])
    assert again["c0"].outputs[0].token_ids == alone[0]


def test_compressed_request_swapped_mid_decode_equals_unpreempted(tiny, make_engine):
    checkpoint, _ = tiny
    policy = CompressionConfig(method="h2o", budget=20, window=4, full_layers=1)
    prompts = [prompt_of(n, seed=20 + n) for n in (60, 50, 55)]
    params = SamplingParams(max_tokens=60, **GREEDY)
    requests = [(f"r{i}", p, params, policy) for i, p in enumerate(prompts)]
    big = run_to_completion(make_engine(checkpoint, block_size=4), requests)
    small_engine = make_engine(checkpoint, block_size=4, num_pages=90)
    small = run_to_completion(small_engine, requests)
    assert small_engine.stats.num_preemptions > 0
    for i in range(3):
        assert small[f"r{i}"].outputs[0].token_ids == big[f"r{i}"].outputs[0].token_ids


def test_chunked_prefill_exact_mode_equals_one_shot(tiny, make_engine):
    checkpoint, _ = tiny
    policy = CompressionConfig(method="snapkv", budget=24, window=4, full_layers=1)
    prompt = prompt_of(90, seed=4)
    one_shot, _ = run_one(make_engine(checkpoint, block_size=4), prompt, 30, policy)
    for chunk in (7, 16, 64):
        chunked, _ = run_one(
            make_engine(checkpoint, block_size=4, max_num_batched_tokens=chunk), prompt, 30, policy
        )
        assert chunked.output_token_ids == one_shot.output_token_ids
        torch.testing.assert_close(
            torch.stack(chunked.logits), torch.stack(one_shot.logits), atol=1e-4, rtol=0
        )


def test_bounded_chunk_mode_keeps_memory_bounded(tiny, make_engine):
    checkpoint, _ = tiny
    policy = CompressionConfig(
        method="snapkv", budget=24, window=4, full_layers=0, chunked_mode="bounded"
    )
    engine = make_engine(checkpoint, block_size=4, max_num_batched_tokens=16)
    prompt = prompt_of(120, seed=5)
    engine.add_request("b", prompt, SamplingParams(max_tokens=5, **GREEDY), policy)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_total_pages - engine.kv.num_free_pages)
    # budget + one chunk per layer at most, never the whole prompt (30 pages per layer).
    assert peak <= 4 * ((24 + 16) // 4 + 1)


@pytest.mark.parametrize("method", ["snapkv", "expected_attention", "kvzip"])
def test_single_shot_prefill_never_holds_uncompressed_pages(tiny, make_engine, method):
    checkpoint, _ = tiny
    budget = 32
    policy = CompressionConfig(method=method, budget=budget, window=4, full_layers=0)
    engine = make_engine(checkpoint, block_size=4)
    prompt = prompt_of(400, seed=6)
    engine.add_request("s", prompt, SamplingParams(max_tokens=1, **GREEDY), policy)
    scheduled = engine.scheduler.schedule()
    allocated = engine.kv.num_total_pages - engine.kv.num_free_pages
    side = engine.kv.get("s").side_pages  # held for the stored window queries
    assert len(side) == engine.scheduler.running[0].policy.kv.side_pages > 0
    # The compressed footprint, not 4 x 100 pages.
    assert allocated - len(side) <= 4 * (budget // 4)
    result = engine.runner.execute(scheduled)
    engine.scheduler.update(scheduled)
    assert result.token_ids
    engine.abort_request("s")


def test_expected_attention_reads_each_layers_rope_frequencies(tiny, make_engine, monkeypatch):
    from sparsekv.compression.expected_attention import ExpectedAttentionCompressor

    checkpoint, _ = tiny
    seen = []
    original = ExpectedAttentionCompressor.score

    def recording(self, view):
        seen.append(view.rope_inv_freq)
        return original(self, view)

    monkeypatch.setattr(ExpectedAttentionCompressor, "score", recording)
    policy = CompressionConfig(method="expected_attention", budget=20, window=4, full_layers=1)
    run_one(make_engine(checkpoint, block_size=4), prompt_of(50, seed=3), 2, policy)
    head_dim = 64 // 4
    theta = checkpoint.hf_config.rope_parameters["rope_theta"]
    expected = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert len(seen) == 3  # the three budgeted layers at the end of the prompt
    for frequencies in seen:
        torch.testing.assert_close(frequencies, expected)


def test_full_layers_past_the_model_is_rejected(tiny, make_engine):
    engine = make_engine(tiny[0])
    params = SamplingParams(max_tokens=2, **GREEDY)
    prompt = prompt_of(40)
    policy = {"method": "snapkv", "budget": 16, "window": 4}
    for full_layers in (4, 9):
        with pytest.raises(ValueError) as caught:
            engine.add_request("a", prompt, params, dict(policy, full_layers=full_layers))
        assert str(caught.value) == (
            f"kv_compression.full_layers ({full_layers}) must be < the model's 4 layers"
        )
    assert not engine.has_unfinished_requests()
    request, _ = run_one(engine, prompt, 2, dict(policy, full_layers=3))
    assert request.policy.layer_budgets == (None, None, None, 16)
    # Explicit per-layer budgets override full_layers, which is then not checked.
    explicit = dict(policy, full_layers=9, layer_budgets=[0, 16, 0, 16])
    request, _ = run_one(engine, prompt, 2, explicit)
    assert request.policy.layer_budgets == (None, 16, None, 16)
