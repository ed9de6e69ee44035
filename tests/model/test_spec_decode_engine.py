"""Speculative decoding in the engine on tiny random Llama models (fp32): greedy output with the
n-gram drafter equals plain decoding token for token, with and without compression, in mixed
batches, across preemption and prefix-cache hits; logprobs, stop strings and ``n > 1``."""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import CompressionConfig, SpeculativeConfig
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_checkpoint, tiny_llama_config

GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_prompt_lookup_max=3)
OFF = {"method": None}


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    config = tiny_llama_config(num_heads=4, num_kv_heads=2)
    return tiny_checkpoint(config, smollm2_tokenizer, seed=3)[0]


def repetitive_prompts(lengths, seed=0):
    """Prompts made of a repeated random segment, so prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        segment = torch.randint(10, 49000, (7,), generator=generator).tolist()
        prompts.append((segment * (n // 7 + 1))[:n])
    return prompts


def generate(engine, prompts, params_list):
    requests = [(f"r{i}", p, params) for i, (p, params) in enumerate(zip(prompts, params_list))]
    done = run_to_completion(engine, requests)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


SNAPKV = CompressionConfig(method="snapkv", budget=40, window=8, full_layers=1)
H2O = CompressionConfig(method="h2o", budget=40, window=8, full_layers=1)


@pytest.mark.parametrize("compression", [None, SNAPKV, H2O], ids=["full", "snapkv", "h2o"])
def test_greedy_equals_plain_in_a_mixed_batch(tiny, make_engine, compression):
    prompts = repetitive_prompts([60, 23, 90, 41])
    params = [SamplingParams(max_tokens=40, **GREEDY) for _ in prompts]
    params[1] = SamplingParams(max_tokens=40, speculative=OFF, **GREEDY)  # opts out
    plain = generate(make_engine(tiny, compression=compression), prompts, params)
    engine = make_engine(tiny, compression=compression, speculative=NGRAM)
    assert generate(engine, prompts, params) == plain
    stats = engine.stats.spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.stats.num_generation_tokens == 40 * len(prompts)
