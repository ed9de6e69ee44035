"""``sparsekv bench serve``: an async load generator for any OpenAI-compatible server.

Streams ``/v1/completions`` (token-id prompts, or text with ``--prompt-format text``) with
``ignore_eos`` and ``max_tokens = --output-len``, so every request returns exactly that many
tokens; ``stream_options.include_usage`` gives the server's token counts. Requests go out at a
fixed concurrency (``--max-concurrency``) and/or as a Poisson process (``--request-rate``).
Each request's timeline (send time, arrival of every chunk with text, usage) is kept; the
figures (TTFT, TPOT, ITL, E2EL, throughput, goodput; docs/benchmarks.md) come from
:mod:`sparsekv.bench.metrics`. Writes a JSON report with provenance (``--output``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sparsekv.bench import metrics
from sparsekv.bench.arg_types import int_at_least
from sparsekv.bench.datasets import DATASETS, PROMPT_FORMATS, BenchPrompt, build_prompts
from sparsekv.cli_help import doc_parser

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


# ------------------------------------------------------------------------------------ CLI
def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Dataset and request-shape flags shared with ``bench sweep``."""
    parser.add_argument(
        "--dataset", choices=DATASETS, default="random", help="where the prompts come from"
    )
    at_least_1 = int_at_least(1)
    parser.add_argument(
        "--input-len", type=at_least_1, default=None, help="prompt tokens (default 4000)"
    )
    parser.add_argument(
        "--output-len", type=at_least_1, default=None, help="output tokens (default 500)"
    )
    parser.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: shared tokens")
    parser.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes, in turn"
    )
    parser.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="token-ids",
        help="send token ids or decoded text",
    )
    parser.add_argument("--tokenizer", default=None, help="for the prompts (default: --model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt sampling")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs: ttft:MS tpot:MS e2el:MS",
    )
    parser.add_argument("--api-key", default=None, help="default: env OPENAI_API_KEY")
    parser.add_argument("--timeout", type=float, default=None, help="per-request seconds")
    parser.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench serve", __doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server under test")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--num-prompts", type=int, default=10, help="requests to send")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: all)",
    )
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second"
    )
    parser.add_argument(
        "--output",
        default="reports/bench_serve.json",
        help="the JSON report (Markdown beside it)",
    )
    add_workload_args(parser)
    return parser


def parse_extra_body(text: str | None) -> dict[str, Any]:
    """``--extra-body`` as a dict.

    Raises:
        ValueError: not a JSON object.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"extra_body: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("extra_body: expected a JSON object")
    return value


def write_document(path: str | Path, document: dict[str, Any], config: dict[str, Any]) -> Path:
    """Write ``document`` plus provenance (load averages too, since other
    jobs on the machine skew timings) as indented JSON, creating the folder."""
    from sparsekv.evaluation.provenance import provenance

    document = dict(document)
    document["provenance"] = provenance(config) | {"load_average": list(os.getloadavg())}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path


def main(argv: list[str] | None = None, *, tokenizer: Any = None, **_: Any) -> int:
    """Parse flags, build the prompts, run the benchmark, print and write the report.

    Args:
        argv: flags (see ``--help``).
        tokenizer: the prompts' tokenizer (tests); loaded from ``--tokenizer`` or ``--model``
            when ``None``.
    """
    from sparsekv.bench.datasets import load_tokenizer

    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model or served_model(args.base_url, api_key)
    input_len, output_len = args.input_len or 4000, args.output_len or 500
    tokenizer = tokenizer or load_tokenizer(args.tokenizer or model)
    prompts = build_prompts(
        tokenizer,
        args.dataset,
        args.num_prompts,
        input_len,
        output_len,
        seed=args.seed,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        prompt_format=args.prompt_format,
    )
    settings = ClientSettings(
        base_url=args.base_url,
        model=model,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        api_key=api_key,
        timeout_s=args.timeout,
        extra_body=parse_extra_body(args.extra_body),
        seed=args.seed,
    )
    slos = metrics.parse_slos(args.goodput)
    summary, timelines = measure(prompts, settings, slos, "bench serve", args.no_progress)
    print(metrics.format_summary(summary))
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config |= {"model": model, "input_len": input_len, "output_len": output_len}
    document = {"summary": summary.to_dict(), "requests": [asdict(t) for t in timelines]}
    path = write_document(args.output, document, config)
    print(f"wrote {path}")
    return 0
