"""Engine-core invariants on tiny random Llama models against Hugging Face (fp32).

Invariants real engines got wrong: greedy outputs equal batched vs alone, chunked vs one-shot, preempted vs not;
logits equal HF's; seeded sampling repeats; pages always return to the pool.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import CompressionConfig
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_checkpoint, tiny_llama_config

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["gqa", "mha"])
def tiny(request, smollm2_tokenizer):
    heads = (4, 2) if request.param == "gqa" else (4, 4)
    config = tiny_llama_config(num_heads=heads[0], num_kv_heads=heads[1])
    return tiny_checkpoint(config, smollm2_tokenizer, seed=1)


def random_prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 49000, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(hf_model, prompt, max_new_tokens):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def greedy_outputs(engine, prompts, max_tokens=24):
    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for i, p in enumerate(prompts)
    ]
    done = run_to_completion(engine, requests)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_logits_and_greedy_match_hf(tiny, make_engine):
    checkpoint, hf_model = tiny
    engine = make_engine(checkpoint)
    prompt = random_prompts([45])[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=32, **GREEDY), collect_logits=True)
    request = engine.scheduler.waiting[0]
    while engine.has_unfinished_requests():
        engine.step()
    tokens = request.output_token_ids
    assert tokens == hf_greedy(hf_model, prompt, 32)
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    ours = torch.stack(request.logits)
    expected = reference[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)


def test_ragged_batch_equals_alone(tiny, make_engine):
    checkpoint, _ = tiny
    prompts = random_prompts([100, 7, 33, 64, 1])
    batched = greedy_outputs(make_engine(checkpoint), prompts)
    for prompt, expected in zip(prompts, batched):
        assert greedy_outputs(make_engine(checkpoint), [prompt]) == [expected]


@pytest.mark.parametrize("chunk", [1, 4, 16, 37])
def test_chunked_prefill_equals_one_shot(tiny, make_engine, chunk):
    checkpoint, _ = tiny
    prompts = random_prompts([100, 37, 50])
    one_shot = greedy_outputs(make_engine(checkpoint), prompts)
    chunked = greedy_outputs(make_engine(checkpoint, max_num_batched_tokens=chunk), prompts)
    assert chunked == one_shot


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_equals_large_pool(tiny, make_engine, mode):
    checkpoint, _ = tiny
    prompts = random_prompts([60, 37, 50, 44], seed=3)
    expected = greedy_outputs(make_engine(checkpoint, block_size=4), prompts, max_tokens=40)
    # Each request peaks at 3 layers x 25 pages; all four at once would need about 250.
    small = make_engine(checkpoint, num_pages=100, block_size=4, preemption_mode=mode)
    got = greedy_outputs(small, prompts, max_tokens=40)
    assert small.stats.num_preemptions > 0
    assert got == expected


def test_seeded_sampling_repeats_also_after_preemption(tiny, make_engine):
    checkpoint, _ = tiny
    prompts = random_prompts([50, 40, 45, 30], seed=5)

    def sample(engine):
        params = [
            SamplingParams(max_tokens=30, temperature=1.0, seed=100 + i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        done = run_to_completion(engine, [(f"s{i}", p, params[i]) for i, p in enumerate(prompts)])
        return [done[f"s{i}"].outputs[0].token_ids for i in range(len(prompts))]

    first = sample(make_engine(checkpoint, block_size=4))
    assert sample(make_engine(checkpoint, block_size=4)) == first
    small = make_engine(checkpoint, num_pages=80, block_size=4)
    assert sample(small) == first
    assert small.stats.num_preemptions > 0


def test_mixed_batch_honours_each_request(tiny, make_engine):
    checkpoint, _ = tiny
    prompt = random_prompts([30], seed=9)[0]
    greedy_alone = greedy_outputs(make_engine(checkpoint), [prompt])[0]
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    alone = run_to_completion(make_engine(checkpoint), [("x", prompt, seeded)])
    engine = make_engine(checkpoint)
    done = run_to_completion(
        engine,
        [
            ("g", prompt, SamplingParams(max_tokens=24, **GREEDY)),
            ("s", prompt, seeded),
            ("k", prompt, SamplingParams(max_tokens=24, temperature=1.0, top_k=1, ignore_eos=True)),
        ],
    )
    assert done["g"].outputs[0].token_ids == greedy_alone
    assert done["s"].outputs[0].token_ids == alone["x"].outputs[0].token_ids
    assert done["k"].outputs[0].token_ids == greedy_alone  # top-k 1 is greedy


def test_n_samples(tiny, make_engine):
    checkpoint, _ = tiny
    prompt = random_prompts([20], seed=2)[0]
    params = SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    done = run_to_completion(make_engine(checkpoint), [("n", prompt, params)])
    outputs = done["n"].outputs
    assert [o.index for o in outputs] == [0, 1]
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outputs)
    assert outputs[0].token_ids != outputs[1].token_ids


def test_abort_frees_pages_at_any_point(tiny, make_engine):
    checkpoint, _ = tiny
    engine = make_engine(checkpoint, max_num_batched_tokens=16)
    prompts = random_prompts([70, 20], seed=4)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()  # "a" is mid-prefill
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    for _ in range(5):
        engine.step()
    engine.abort_request("b")
    assert engine.abort_request("missing") is None
    assert not engine.has_unfinished_requests()


def test_prompt_over_context_is_rejected(tiny, make_engine):
    checkpoint, _ = tiny
    engine = make_engine(checkpoint)
    prompt = random_prompts([100])[0]
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("a", prompt, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("c", [10**7], SamplingParams())


def test_request_that_never_fits_is_rejected_at_arrival(tiny, make_engine):
    checkpoint, _ = tiny
    engine = make_engine(checkpoint, num_pages=60, block_size=4)
    prompt = random_prompts([200])[0]
    with pytest.raises(ValueError, match="pages"):
        engine.add_request("a", prompt, SamplingParams(max_tokens=100))
    # A budget makes the same request fit: compressed footprints count.
    policy = CompressionConfig(method="snapkv", budget=16, window=4, full_layers=0)
    engine.add_request("b", prompt, SamplingParams(max_tokens=100, **GREEDY), policy)
    while engine.has_unfinished_requests():
        engine.step()
