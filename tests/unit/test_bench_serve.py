"""``sparsekv bench serve`` end to end against a tiny fake OpenAI server in this process.

The fake server streams canned chunks with known delays (first token after ``FIRST_S``, then
one token every ``GAP_S``), so TTFT, TPOT and ITL must land in known ranges (lower bounds are
exact; upper bounds are loose because the machine may be loaded). No timing is asserted
beyond those physical bounds.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from sparsekv.bench import serve
from sparsekv.bench.datasets import build_prompts

FIRST_S = 0.05
GAP_S = 0.01


class ToyTokenizer:
    """Just enough of a tokenizer for the random dataset: 1000 ids, 0-2 special."""

    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict = {}

    def __len__(self) -> int:
        return 1000

    def decode(self, ids) -> str:
        return " ".join(f"t{i}" for i in ids)


def _chunk(choices, usage=None) -> str:
    body = {"id": "c", "object": "text_completion", "model": "toy", "choices": choices}
    return "data: " + json.dumps(body | {"usage": usage}) + "\n\n"


def fake_app() -> FastAPI:
    app = FastAPI()
    app.state.bodies = []
    app.state.hits = [0, 0]  # prefix-cache hit tokens of two replicas

    @app.get("/metrics")
    async def prometheus():
        lines = ["# TYPE sparsekv_prefix_cache_hit_tokens counter"]
        for replica, hits in enumerate(app.state.hits):
            lines.append(f'sparsekv_prefix_cache_hit_tokens_total{{replica="{replica}"}} {hits}')
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "toy", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        if body["model"] == "broken":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        count = body["max_tokens"]
        app.state.hits[0] += 2  # half of a 10-token prompt, split over the two replicas
        app.state.hits[1] += 3

        async def events():
            await asyncio.sleep(FIRST_S)
            for index in range(count):
                if index:
                    await asyncio.sleep(GAP_S)
                choice = {"index": 0, "text": "x", "finish_reason": None}
                yield _chunk([choice])
                if body["model"] == "midstream":
                    yield "data: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
            yield _chunk([{"index": 0, "text": "", "finish_reason": "length"}])
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": count}
            yield _chunk([], usage | {"kv_compression_ratio": 0.25})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server():
    app = fake_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the fake server did not start"
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(timeout=10)


def _run(tmp_path, base_url, *extra) -> dict:
    out = tmp_path / "serve.json"
    argv = ["--base-url", base_url, "--input-len", "12", "--output-len", "5", "--no-progress"]
    argv += ["--output", str(out), *extra]
    assert serve.main(argv, tokenizer=ToyTokenizer()) == 0
    return json.loads(out.read_text())


def test_streams_at_fixed_concurrency_and_measures(tmp_path, fake_server):
    base_url, app = fake_server
    app.state.bodies.clear()
    document = _run(
        tmp_path, base_url, "--num-prompts", "6", "--max-concurrency", "2",
        "--goodput", "ttft:60000", "tpot:60000",
    )  # fmt: skip
    summary = document["summary"]
    assert summary["num_completed"] == 6 and summary["num_failed"] == 0
    assert summary["total_output_tokens"] == 30 and summary["total_input_tokens"] == 72
    assert 1 <= summary["peak_concurrency"] <= 2
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert summary["mean_kv_compression_ratio"] == pytest.approx(0.25)
    # Physical lower bounds from the canned delays; loose upper bounds.
    assert 1000 * FIRST_S <= summary["ttft_ms_p50"] < 5000
    assert 1000 * GAP_S * 0.9 <= summary["tpot_ms_mean"] < 5000
    assert 1000 * GAP_S * 0.9 <= summary["itl_ms_p50"] < 5000
    assert summary["e2el_ms_p50"] >= 1000 * (FIRST_S + 4 * GAP_S)
    requests = document["requests"]
    assert len(requests) == 6 and all(len(r["token_times_s"]) == 5 for r in requests)
    assert document["provenance"]["config"]["model"] == "toy"  # found via /v1/models
    markdown = (tmp_path / "serve.md").read_text()
    assert markdown.startswith("# Serving benchmark\n\n| metric | value |")
    assert "| num_completed | 6 |" in markdown and markdown.endswith("Full report: serve.json\n")
    body = app.state.bodies[0]
    assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"]) == 12 and all(3 <= t < 1000 for t in body["prompt"])


def test_poisson_arrivals_text_prompts_and_extra_body(tmp_path, fake_server):
    base_url, app = fake_server
    app.state.bodies.clear()
    extra = json.dumps({"kv_compression": {"method": "snapkv", "budget": 64}})
    document = _run(
        tmp_path, base_url, "--num-prompts", "3", "--request-rate", "50",
        "--prompt-format", "text", "--extra-body", extra,
    )  # fmt: skip
    assert document["summary"]["num_completed"] == 3
    assert all(isinstance(b["prompt"], str) for b in app.state.bodies)
    assert all(b["kv_compression"] == {"method": "snapkv", "budget": 64} for b in app.state.bodies)


@pytest.mark.parametrize("model", ["broken", "midstream"])
def test_server_errors_are_counted_not_raised(tmp_path, fake_server, model):
    base_url, _ = fake_server
    document = _run(tmp_path, base_url, "--model", model, "--num-prompts", "3")
    summary = document["summary"]
    assert summary["num_completed"] == 0 and summary["num_failed"] == 3
    expected = "HTTP 500" if model == "broken" else "stream error: engine died"
    assert summary["errors"] and summary["errors"][0].startswith(expected)
    assert summary["output_throughput"] == 0.0


def test_connection_refused_is_counted(tmp_path):
    document = _run(
        tmp_path, f"http://127.0.0.1:{free_port()}", "--model", "toy", "--num-prompts", "2"
    )
    assert document["summary"]["num_failed"] == 2
    assert "ConnectError" in document["summary"]["errors"][0]


def test_shared_prefix_prompts_share_exactly_the_prefix():
    prompts = build_prompts(ToyTokenizer(), "shared-prefix", 3, 20, 4, seed=1, prefix_len=8)
    assert all(p.num_prompt_tokens == 20 and len(p.prompt) == 20 for p in prompts)
    assert len({tuple(p.prompt[:8]) for p in prompts}) == 1
    assert len({tuple(p.prompt[8:]) for p in prompts}) == 3
    with pytest.raises(ValueError, match="prefix_len"):
        build_prompts(ToyTokenizer(), "shared-prefix", 3, 20, 4, prefix_len=20)


def test_shared_prefix_groups_take_their_prefixes_in_turn():
    prompts = build_prompts(
        ToyTokenizer(), "shared-prefix", 7, 20, 4, seed=1, prefix_len=8, num_prefixes=3
    )
    heads = [tuple(p.prompt[:8]) for p in prompts]
    assert len(set(heads)) == 3
    assert heads[:3] == heads[3:6] and heads[6] == heads[0]
    assert len({tuple(p.prompt[8:]) for p in prompts}) == 7
    with pytest.raises(ValueError, match="num_prefixes"):
        build_prompts(ToyTokenizer(), "shared-prefix", 3, 20, 4, prefix_len=8, num_prefixes=0)


def test_sweep_against_an_external_server_and_a_server_that_fails_to_start(tmp_path, fake_server):
    from sparsekv.bench import sweep

    base_url, _ = fake_server
    out = tmp_path / "sweep.json"
    argv = ["--configs", "bad:--kv-compression bogus", "--external", f"fake={base_url}"]
    argv += ["--quick", "--input-len", "10", "--output-len", "3", "--startup-timeout", "60"]
    argv += ["--no-progress", "--output", str(out)]
    assert sweep.main(argv, tokenizer=ToyTokenizer()) == 1  # one configuration failed
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert [(r["config"], r["concurrency"], r["num_prompts"]) for r in rows] == [
        ("fake", 1, 2),
        ("fake", 5, 2),
        ("fake", 10, 2),
    ]
    assert all(r["failed"] == 0 and r["output_tok_per_s"] > 0 for r in rows)
    assert [r["prefix_hit_rate"] for r in rows] == [0.5, 0.5, 0.5]  # from /metrics, summed
    assert "exited" in document["provenance"]["errors"]["bad"]
    assert out.with_suffix(".png").exists() and out.with_name("sweep_ttft.png").exists()
    assert "TTFT P50" in out.with_suffix(".md").read_text()
    levels = json.loads(out.with_name("sweep_levels.json").read_text())["levels"]["fake"]
    assert sum(len(level["requests"]) for level in levels) == 6


def test_a_level_served_from_the_prefix_cache_is_flagged():
    from sparsekv.bench import sweep

    assert sweep.prefix_hit_warning(None) is None and sweep.prefix_hit_warning(0.5) is None
    warning = sweep.prefix_hit_warning(0.96)
    assert warning.startswith("96% of the prompt tokens came from the prefix cache")
    assert "change --seed" in warning


def test_sweep_level_sizes():
    from sparsekv.bench import sweep

    parse = sweep.build_parser().parse_args
    assert sweep.level_sizes(parse([]), [1, 2, 5]) == [2, 4, 10]
    assert sweep.level_sizes(parse(["--quick"]), [1, 5, 10]) == [2, 2, 2]
    assert sweep.level_sizes(parse(["--prompts-per-slot", "3"]), [1, 5]) == [3, 15]
    assert sweep.level_sizes(parse(["--num-prompts-per-level", "4"]), [1, 5]) == [4, 4]
    targets = sweep.parse_targets(["a:--kv-budget 512 --kv-full-layers 2"], ["v=http://h:1"])
    assert targets[0].flags == ("--kv-budget", "512", "--kv-full-layers", "2")
    assert targets[1].url == "http://h:1"
    with pytest.raises(ValueError, match="distinct"):
        sweep.parse_targets(["a:", "a:"], [])
    args = parse(["--input-len", "6", "--output-len", "2"])
    pools = sweep.build_pools(args, [1, 2, 3], ToyTokenizer())
    assert [len(pool) for pool in pools] == [1, 2, 3]
    assert len({tuple(p.prompt) for pool in pools for p in pool}) == 6  # no repeat across levels
