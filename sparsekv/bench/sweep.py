"""``sparsekv bench sweep``: the same concurrency sweep against several servers, one report.

Each ``--configs NAME:FLAGS`` entry starts a ``sparsekv serve`` subprocess on 127.0.0.1 (a free
port; ``--model``, ``--kv-cache-memory`` and ``--server-args`` added to every one), waits for
``/health`` to answer 200, runs one warm-up request and then every concurrency level, and stops
the server with SIGTERM before the next one starts, so configurations never share the CPU.
``--external NAME=URL`` adds servers already running (vLLM, llama.cpp...), measured the same way.

Every level sends its own prompts (no prompt repeats across levels, so a prefix cache never
turns the sweep into cache hits); every server gets the same prompts. Default preset
(the sweep shape, docs/benchmarks.md): 4000 input / 500 output tokens at concurrency 1, 2, 5, 10, 20 with two
requests per concurrency slot; ``--quick``: 1, 5, 10 with 2 requests per level.

Writes ``<output>.json`` / ``.md`` / ``.png`` (output throughput vs concurrency, one line per
configuration), ``<stem>_ttft.png`` (TTFT P50 vs concurrency), ``<stem>_levels.json`` (full
summaries and per-request timelines) and the server logs beside them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sparsekv.bench import metrics, serve
from sparsekv.bench.arg_types import int_at_least
from sparsekv.bench.datasets import BenchPrompt, build_prompts, load_tokenizer
from sparsekv.bench.sweep_report import row_of, write_sweep_report
from sparsekv.bench.sweep_servers import (
    HIT_TOKENS_METRIC,
    Target,
    free_port,
    parse_targets,
    prefix_hit_tokens,
    server_flags,
    sparsekv_server,
    wait_healthy,
)
from sparsekv.cli_help import doc_parser

__all__ = [
    "DEFAULT_CONFIGS",
    "FULL_LEVELS",
    "HIT_TOKENS_METRIC",
    "QUICK_LEVELS",
    "Target",
    "build_parser",
    "build_pools",
    "free_port",
    "level_sizes",
    "main",
    "parse_targets",
    "prefix_hit_tokens",
    "row_of",
    "run_sweep",
    "server_flags",
    "sparsekv_server",
    "sweep_target",
    "wait_healthy",
    "write_sweep_report",
]

DEFAULT_CONFIGS = ("full:--kv-compression none", "snapkv1024:--kv-compression snapkv")
FULL_LEVELS, QUICK_LEVELS = (1, 2, 5, 10, 20), (1, 5, 10)


def level_sizes(args: argparse.Namespace, levels: list[int]) -> list[int]:
    """Requests per level: ``--num-prompts-per-level`` or ``--prompts-per-slot`` x concurrency."""
    if args.num_prompts_per_level is not None:
        return [args.num_prompts_per_level] * len(levels)
    if args.prompts_per_slot is not None:
        return [args.prompts_per_slot * c for c in levels]
    return [2] * len(levels) if args.quick else [2 * c for c in levels]


def sweep_target(
    url: str, target: Target, pools: list[list[BenchPrompt]], levels, args, slos
) -> list[dict]:
    """Warm up, then run every level against one server; ``[{row, summary, requests}]``."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    settings = serve.ClientSettings(
        base_url=url,
        model=args.served_model or serve.served_model(url, api_key),
        api_key=api_key,
        timeout_s=args.timeout,
        extra_body=serve.parse_extra_body(args.extra_body),
    )
    warm = [BenchPrompt(pools[0][0].prompt[:16], 16, 2)]
    serve.measure(warm, settings, {}, f"{target.name} warm-up", quiet=True)
    results = []
    for concurrency, prompts in zip(levels, pools):
        settings.max_concurrency = concurrency
        hits_before = prefix_hit_tokens(url)
        summary, timelines = serve.measure(
            prompts, settings, slos, f"{target.name} c={concurrency}", args.no_progress
        )
        hits_after = prefix_hit_tokens(url)
        hits = None if None in (hits_before, hits_after) else hits_after - hits_before
        row = row_of(target.name, concurrency, summary, hits)
        print(
            f"[{target.name} c={concurrency}] {summary.output_throughput:.1f} output tok/s, "
            f"TTFT P50 {summary.ttft.p50:.0f} ms, {summary.num_failed} failed"
        )
        warning = prefix_hit_warning(row["prefix_hit_rate"])
        if warning:
            print(f"[{target.name} c={concurrency}] warning: {warning}")
        results.append(
            {"row": row, "summary": summary.to_dict(), "requests": [asdict(t) for t in timelines]}
        )
    return results


# A level whose prompts were mostly served from the prefix cache measured cache hits, not prefill
# (the prompts are random; a fresh server hits only the chat template's few tokens).
PREFIX_HIT_WARNING = 0.5


def prefix_hit_warning(hit_rate: float | None) -> str | None:
    """The warning for a level whose prompt tokens came mostly from the server's prefix cache
    (more than :data:`PREFIX_HIT_WARNING` of them), else ``None``."""
    if hit_rate is None or hit_rate <= PREFIX_HIT_WARNING:
        return None
    return (
        f"{hit_rate:.0%} of the prompt tokens came from the prefix cache: the server has served "
        "these prompts before (an earlier run with the same --seed); restart it or change "
        "--seed to measure prefill"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench sweep", __doc__)
    parser.add_argument(
        "--configs", nargs="*", default=list(DEFAULT_CONFIGS), metavar="NAME:FLAGS",
        help="sparsekv servers to start, e.g. 'snapkv512:--kv-compression snapkv --kv-budget 512'",
    )  # fmt: skip
    parser.add_argument("--external", nargs="+", default=[], metavar="NAME=URL")
    at_least_1 = int_at_least(1)
    parser.add_argument("--concurrency", type=at_least_1, nargs="+", default=None)
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--num-prompts-per-level", type=at_least_1, default=None, help="requests per level"
    )
    sizes.add_argument(
        "--prompts-per-slot",
        type=at_least_1,
        default=None,
        help="requests per level = N x concurrency",
    )
    parser.add_argument("--quick", action="store_true", help="1, 5, 10 with 2 requests per level")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="every sparsekv side")
    parser.add_argument("--served-model", default=None, help="request model id (default: asked)")
    parser.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB, every side")
    parser.add_argument("--server-args", default="", help="more flags for every sparsekv side")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds")
    parser.add_argument("--output", default="reports/sweep.json")
    serve.add_workload_args(parser)
    return parser


def build_pools(args: argparse.Namespace, sizes: list[int], tokenizer) -> list[list[BenchPrompt]]:
    """Distinct prompts for every level (one seeded set, cut in level order)."""
    prompts = build_prompts(
        tokenizer,
        args.dataset,
        sum(sizes),
        args.input_len,
        args.output_len,
        seed=args.seed,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        prompt_format=args.prompt_format,
    )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [prompts[start : start + size] for start, size in zip(starts, sizes)]


def run_sweep(args: argparse.Namespace, tokenizer=None) -> dict[str, Any]:
    """Measure every target at every level; write and return the report document."""
    load_start = list(os.getloadavg())
    args.input_len = args.input_len or 4000
    args.output_len = args.output_len or 500
    levels = args.concurrency or list(QUICK_LEVELS if args.quick else FULL_LEVELS)
    sizes = level_sizes(args, levels)
    targets = parse_targets(args.configs, args.external)
    slos = metrics.parse_slos(args.goodput)
    tokenizer = tokenizer or load_tokenizer(args.tokenizer or args.model)
    pools = build_pools(args, sizes, tokenizer)
    out = Path(args.output)
    results: dict[str, list[dict]] = {}
    errors: dict[str, str] = {}
    for target in targets:
        log = out.with_name(f"{out.stem}_{target.name}.log")
        try:
            if target.url is not None:
                results[target.name] = sweep_target(target.url, target, pools, levels, args, slos)
                continue
            flags = server_flags(target, args)
            with sparsekv_server(flags, log, args.startup_timeout) as url:
                results[target.name] = sweep_target(url, target, pools, levels, args, slos)
        except (RuntimeError, ValueError) as exc:
            errors[target.name] = str(exc)
            print(f"error: {target.name}: {exc}", file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}
    settings |= {"levels": levels, "num_prompts": sizes, "load_average_start": load_start}
    return write_sweep_report(out, results, errors, settings)


def main(argv: list[str] | None = None, *, tokenizer=None, **_: Any) -> int:
    """Parse flags, run the sweep, print the table; 1 if a configuration failed."""
    from sparsekv.bench.common import format_table

    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    document = run_sweep(args, tokenizer)
    columns = ("config", "concurrency", "num_prompts", "failed", "output_tok_per_s")
    columns += ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "kv_ratio")
    print(format_table(document["rows"], columns))
    print(f"wrote {document['files'].json} (+ .md, .png, _ttft.png, _levels.json)")
    return 1 if document["errors"] else 0
