"""Server fixtures: the real `sparsekv serve` (SmolLM2, fp32) in a subprocess, started once per
session, plus an in-process uvicorn helper for servers built around a custom engine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "sk-test-sparsekv"
FAULT_MARKER = "@@inject-step-fault@@"
MAX_BODY_BYTES = 256 * 1024
MODEL = "smollm2-135m-instruct"
STARTUP_TIMEOUT_S = 600  # a first start may compile the native kernels


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value; return it (or the last falsy one)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def read_metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped; histograms keep _count and _sum)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                samples[sample.name] = sample.value
    return samples


class ServerProcess:
    """`python -m sparsekv.cli serve ...` in a subprocess, restarted on demand."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "sparsekv.cli", "serve",
            "--model", MODEL, "--dtype", "float32", "--kv-cache-memory", "0.25",
            "--port", str(self.port), "--api-key", API_KEY,
            "--max-body-bytes", str(MAX_BODY_BYTES),
        ]  # fmt: skip

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> ServerProcess:
        if self.is_running():
            return self
        self.port = free_port()
        env = dict(os.environ, SPARSEKV_TEST_FAULT_MARKER=FAULT_MARKER)
        env.pop("SPARSEKV_API_KEY", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd()
        )
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited at startup:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, num_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


@pytest.fixture(scope="session")
def server_process(tmp_path_factory):
    """The session's `sparsekv serve` process (started lazily, stopped at the end)."""
    handle = ServerProcess(tmp_path_factory.mktemp("server") / "server.log")
    yield handle
    handle.stop()


@pytest.fixture
def server(server_process) -> ServerProcess:
    """A running real server (SmolLM2 fp32, API key, test fault hook on)."""
    return server_process.ensure_running()


class InProcessServer:
    """uvicorn.Server for an app in a background thread (no signal handlers)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> InProcessServer:
        self.thread.start()
        if not wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout):
            raise RuntimeError("in-process server did not start")
        if not self.server.started:
            raise RuntimeError("in-process server failed at startup")
        return self

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
