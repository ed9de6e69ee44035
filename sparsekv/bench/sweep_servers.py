"""The servers a sweep measures: the configurations to run, and each server's life.

A ``Target`` is a ``sparsekv serve`` to start with its flags or a server already running at a
URL. ``sparsekv_server`` starts one on a free local port, waits for ``/health`` and stops it
with SIGTERM at exit; ``prefix_hit_tokens`` reads a server's prefix-cache counter from
``/metrics``.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Target:
    """One configuration of the sweep: a server to start (``flags``) or a running one (``url``)."""

    name: str
    flags: tuple[str, ...] = ()
    url: str | None = None


def parse_targets(configs: list[str], externals: list[str]) -> list[Target]:
    """``NAME:FLAGS`` and ``NAME=URL`` strings -> targets.

    Raises:
        ValueError: a malformed entry or a repeated name.
    """
    targets = []
    for entry in configs:
        name, sep, flags = entry.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"configs: expected NAME:FLAGS, got {entry!r}")
        targets.append(Target(name.strip(), tuple(shlex.split(flags))))
    for entry in externals:
        name, sep, url = entry.partition("=")
        if not sep or not name.strip() or not url.startswith("http"):
            raise ValueError(f"external: expected NAME=http://HOST:PORT, got {entry!r}")
        targets.append(Target(name.strip(), url=url.strip()))
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"configs: names must be distinct, got {names}")
    return targets


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen | None, timeout_s: float, log: Path) -> None:
    """Poll ``url/health`` until it answers 200.

    Raises:
        RuntimeError: the process exited or ``timeout_s`` passed (with the log's tail).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    state = "exited" if process is not None and process.poll() is not None else "timed out"
    raise RuntimeError(f"server at {url} {state} before /health answered 200:\n{tail}")


@contextmanager
def sparsekv_server(flags: list[str], log: Path, timeout_s: float) -> Iterator[str]:
    """Run ``sparsekv serve FLAGS`` on a free local port; yield its URL; SIGTERM it at exit."""
    port = free_port()
    command = [sys.executable, "-m", "sparsekv.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), *flags]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, process, timeout_s, log)
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def server_flags(target: Target, args: argparse.Namespace) -> list[str]:
    """The flags of one sparsekv side: the shared ones first, the configuration's last."""
    flags = ["--model", args.model, "--kv-cache-memory", str(args.kv_cache_memory)]
    return flags + shlex.split(args.server_args or "") + list(target.flags)


HIT_TOKENS_METRIC = "sparsekv_prefix_cache_hit_tokens_total"


def prefix_hit_tokens(url: str) -> float | None:
    """Prompt tokens the server's prefix cache has served so far, summed over its replicas
    (``/metrics``), or ``None`` where the server does not export the counter (another
    engine) or does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        samples = [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == HIT_TOKENS_METRIC
        ]
    except (httpx.HTTPError, ValueError):
        return None
    return sum(samples) if samples else None
