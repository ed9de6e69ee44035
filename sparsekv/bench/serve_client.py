"""The client side of ``sparsekv bench serve``: streamed completion requests, timed.

``ClientSettings`` (how to reach the server), one request's body and its streamed timeline
(``stream_request``: send time, the arrival of every chunk with text, the server's usage), and
a whole run (``run_benchmark``: fixed concurrency and/or Poisson arrivals; ``measure``: the
same with a progress bar, summarized by :mod:`sparsekv.bench.metrics`). A request's failure is
recorded in its timeline, never raised. The command line and the JSON report are in
:mod:`sparsekv.bench.serve`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from sparsekv.bench import metrics
from sparsekv.bench.datasets import BenchPrompt

ERROR_TEXT_LIMIT = 300  # characters of an error body kept per failure


@dataclass
class ClientSettings:
    """How the load generator talks to the server.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is appended).
        model: the ``model`` field of every request.
        max_concurrency: requests in flight at most (``None``: no limit).
        request_rate: mean arrivals per second of a Poisson process (``inf``: all at once).
        api_key: sent as ``Authorization: Bearer`` when given.
        timeout_s: per-request read timeout in seconds (``None``: wait forever).
        extra_body: fields merged into every request body (e.g. ``kv_compression``).
        seed: seeds the Poisson arrivals.
    """

    base_url: str
    model: str
    max_concurrency: int | None = None
    request_rate: float = math.inf
    api_key: str | None = None
    timeout_s: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def validate(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 requests per second")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def completions_url(base_url: str) -> str:
    """``/v1/completions`` under ``base_url`` (which may or may not end in ``/v1``)."""
    root = base_url.rstrip("/")
    return (root if root.endswith("/v1") else root + "/v1") + "/completions"


def request_body(item: BenchPrompt, settings: ClientSettings) -> dict[str, Any]:
    """The streamed, EOS-ignoring completion request of one prompt."""
    body = {
        "model": settings.model,
        "prompt": item.prompt,
        "max_tokens": item.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return body | settings.extra_body


def _record_event(timeline: metrics.RequestTimeline, event: dict, now: float) -> int:
    """Fold one SSE event into ``timeline``; return the number of chunks with text (0 or 1)."""
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        timeline.error = f"stream error: {str(message)[:ERROR_TEXT_LIMIT]}"
        return 0
    usage = event.get("usage")
    if usage:
        timeline.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
        timeline.num_output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("kv_compression_ratio") is not None:
            timeline.kv_compression_ratio = float(usage["kv_compression_ratio"])
    if any(choice.get("text") for choice in event.get("choices") or []):
        timeline.token_times_s.append(now)
        return 1
    return 0


async def stream_request(
    client: httpx.AsyncClient, url: str, item: BenchPrompt, settings: ClientSettings, clock
) -> metrics.RequestTimeline:
    """Send one streamed request and time its chunks; failures are recorded, never raised.

    Args:
        client: shared HTTP client.
        url: the completions endpoint.
        item: the prompt.
        settings: model, headers and extra body fields.
        clock: ``() -> seconds`` on the run's clock.
    """
    timeline = metrics.RequestTimeline(send_s=clock())
    num_chunks = 0
    try:
        body = request_body(item, settings)
        async with client.stream("POST", url, json=body, headers=settings.headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                timeline.error = f"HTTP {response.status_code}: {text[:ERROR_TEXT_LIMIT]}"
                return timeline
            async for line in response.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                num_chunks += _record_event(timeline, json.loads(data), now)
                if timeline.error is not None:
                    break
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        timeline.error = f"{type(exc).__name__}: {str(exc)[:ERROR_TEXT_LIMIT]}"
    finally:
        timeline.end_s = clock()
    if timeline.num_output_tokens == 0:  # no usage reported: one token per chunk
        timeline.num_output_tokens = num_chunks
    if timeline.num_prompt_tokens == 0:
        timeline.num_prompt_tokens = item.num_prompt_tokens
    return timeline


async def _arrivals(count: int, rate: float, seed: int):
    """Yield ``0..count-1``, spaced by exponential gaps of mean ``1 / rate`` seconds."""
    rng = random.Random(seed)
    for index in range(count):
        if index and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield index


async def run_benchmark(
    prompts: Sequence[BenchPrompt], settings: ClientSettings, progress=None
) -> tuple[list[metrics.RequestTimeline], float]:
    """Send every prompt and wait for all of them.

    Returns:
        ``(timelines in prompt order, duration in seconds from the first send to the last
        response's end)``.

    Raises:
        ValueError: ``settings`` out of range (``ClientSettings.validate``).
    """
    settings.validate()
    url = completions_url(settings.base_url)
    width = settings.max_concurrency or len(prompts)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    timeout = httpx.Timeout(settings.timeout_s, connect=30.0)
    gate = asyncio.Semaphore(width)
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def one(item: BenchPrompt) -> metrics.RequestTimeline:
        async with gate:
            timeline = await stream_request(client, url, item, settings, clock)
        if progress is not None:
            progress.update(1)
        return timeline

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = []
        async for index in _arrivals(len(prompts), settings.request_rate, settings.seed):
            tasks.append(asyncio.create_task(one(prompts[index])))
        timelines = list(await asyncio.gather(*tasks))
    return timelines, max(clock(), 1e-9)


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        ValueError: the server is unreachable or lists no model.
    """
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{root}/v1/models", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"base_url: cannot list the models of {root}: {exc}") from None


def measure(prompts: Sequence[BenchPrompt], settings: ClientSettings, slos, desc: str, quiet: bool):
    """Run one benchmark with a tqdm bar; return ``(summary, timelines)``."""
    from tqdm import tqdm

    with tqdm(total=len(prompts), desc=desc, unit="req", disable=quiet) as bar:
        timelines, duration = asyncio.run(run_benchmark(prompts, settings, bar))
    return metrics.summarize(timelines, duration, slos), timelines
