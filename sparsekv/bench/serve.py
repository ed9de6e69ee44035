"""``sparsekv bench serve``: an async load generator for any OpenAI-compatible server.

Streams ``/v1/completions`` (token-id prompts, or text with ``--prompt-format text``) with
``ignore_eos`` and ``max_tokens = --output-len``, so every request returns exactly that many
tokens; ``stream_options.include_usage`` gives the server's token counts. Requests go out at a
fixed concurrency (``--max-concurrency``) and/or as a Poisson process (``--request-rate``).
Each request's timeline (send time, arrival of every chunk with text, usage) is kept; the
figures (TTFT, TPOT, ITL, E2EL, throughput, goodput; docs/benchmarks.md) come from
:mod:`sparsekv.bench.metrics`. Writes a JSON report with provenance (``--output``) and a Markdown summary beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sparsekv.bench import metrics
from sparsekv.bench.arg_types import int_at_least
from sparsekv.bench.datasets import DATASETS, PROMPT_FORMATS, build_prompts
from sparsekv.bench.serve_client import (
    ERROR_TEXT_LIMIT,
    ClientSettings,
    completions_url,
    measure,
    request_body,
    run_benchmark,
    served_model,
    stream_request,
)
from sparsekv.cli_help import doc_parser

# This module is the command line and the report; the requests and their timing are in
# bench/serve_client.py (its names are re-exported here).
__all__ = [
    "ERROR_TEXT_LIMIT",
    "ClientSettings",
    "add_workload_args",
    "build_parser",
    "completions_url",
    "main",
    "measure",
    "parse_extra_body",
    "request_body",
    "run_benchmark",
    "served_model",
    "stream_request",
    "write_document",
]


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


def write_summary_markdown(json_path: Path, summary: dict[str, Any]) -> Path:
    """The summary as a metric / value table beside the JSON report (same name, ``.md``)."""
    from sparsekv.evaluation.report import markdown_table

    rows = [{"metric": name, "value": value} for name, value in summary.items()]
    path = json_path.with_suffix(".md")
    path.write_text(
        f"# Serving benchmark\n\n{markdown_table(rows)}\n\nFull report: {json_path.name}\n"
    )
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
    markdown = write_summary_markdown(path, document["summary"])
    print(f"wrote {path} and {markdown}")
    return 0
