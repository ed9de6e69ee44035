"""``RequestOutput.num_cached_tokens`` (the server's ``usage.prompt_tokens_details
.cached_tokens``): prompt tokens a request took from the prefix cache, whole pages short of the
last prompt token, once per request; 0 with prefix caching off. Tiny random Llama, fp32."""

from __future__ import annotations

import pytest
import torch

from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_checkpoint, tiny_llama_config

BLOCK = 8


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    return tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=1)[0]


def tokens_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (length,), generator=generator).tolist()


def cached(engine, request_id: str, prompt: list[int], n: int = 1) -> int:
    params = SamplingParams(max_tokens=3, n=n, temperature=0.0, ignore_eos=True)
    return run_to_completion(engine, [(request_id, prompt, params)])[request_id].num_cached_tokens


@pytest.mark.parametrize("length, expected", [(41, 40), (40, 32), (8, 0)])
def test_a_repeated_prompt_reports_its_whole_cached_pages(tiny, make_engine, length, expected):
    # The last prompt token is always recomputed: (length - 1) // block * block tokens hit.
    assert expected == (length - 1) // BLOCK * BLOCK
    engine = make_engine(tiny, block_size=BLOCK)
    prompt = tokens_of(length, 3)
    assert cached(engine, "first", prompt) == 0
    assert cached(engine, "second", prompt) == expected
    assert engine.stats.num_prefix_cache_hit_tokens == expected


def test_prefix_caching_off_reports_zero(tiny, make_engine):
    engine = make_engine(tiny, block_size=BLOCK, prefix_caching=False)
    prompt = tokens_of(41, 4)
    assert [cached(engine, rid, prompt) for rid in ("first", "second")] == [0, 0]


def test_n_samples_count_the_request_once(tiny, make_engine):
    # The second sample takes the first's prompt pages (a hit in the engine's counters), but
    # the request found nothing cached: 0, as OpenAI counts prompt tokens once per request.
    engine = make_engine(tiny, block_size=BLOCK)
    prompt = tokens_of(41, 5)
    assert cached(engine, "cold", prompt, n=2) == 0
    assert engine.stats.num_prefix_cache_hit_tokens == 40
    assert cached(engine, "warm", prompt, n=2) == 40
