"""``sparsekv eval --suite ruler``: flags resolved, the grid run, the reports written."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tqdm import tqdm

from sparsekv.bench import common
from sparsekv.cli_args import engine_config_from_args
from sparsekv.evaluation import (
    ruler_cells,
    ruler_cost,
    ruler_data,
    ruler_report,
    ruler_run,
    ruler_share,
    ruler_tasks,
)

PROTOCOL_CHOICES = ("both", *ruler_run.PROTOCOLS)


def run(args: argparse.Namespace, grid: dict, checkpoint=None) -> int:
    """Run the official RULER tasks for ``grid`` (tasks default to all 13, one length 4096).

    Raises:
        ValueError: the ``ruler`` extra is not installed (checked before the model loads), an
            unknown task, method or protocol.
    """
    try:
        ruler_data.package_root()
    except ImportError as exc:  # one error line from the CLI, not a traceback
        raise ValueError(str(exc)) from None
    load_start = common.load_average()
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    tasks = grid["tasks"] if args.tasks else list(ruler_tasks.load_tasks())
    lengths = grid["lengths"] if args.lengths else [4096]
    protocols = list(ruler_run.PROTOCOLS) if args.protocol == "both" else [args.protocol]
    cells = ruler_cells.grid_cells(grid["methods"], grid["ratios"], config.compression)
    start = time.perf_counter()
    cases = ruler_run.build_cases(checkpoint.tokenizer, tasks, lengths, grid["samples"],
                                  args.seed, args.prompt_format)  # fmt: skip
    cases = ruler_run.interleave(cases)
    generate_s = time.perf_counter() - start
    runs = sum(1 if c.method == "none" else len(protocols) for c in cells)
    cost = _prefill_cost(args, config, checkpoint, cases, cells, protocols)
    if args.share_group:
        max_prompt = max(len(c.prompt_ids) for c in cases)
        max_tokens = max(c.max_tokens for c in cases)
        group_requests = args.share_group * (runs + 1)
        config = ruler_share.sharing_config(
            config, max_prompt, max_tokens, args.share_group, group_requests
        )
    engine = common.build_engine(config, checkpoint)
    work = sum(len(c.prompt_ids) + c.max_tokens for c in cases) * runs
    bar = tqdm(total=work, unit="tok", unit_scale=True, desc="ruler", disable=args.no_progress)
    out = Path(args.output_dir)
    partial = _partial_writer(out / "ruler_partial.jsonl")
    stats_before = dataclasses.replace(engine.stats)
    start = time.perf_counter()
    rows = ruler_run.run(engine, cases, cells, protocols, progress=bar,
                         share_group=args.share_group, on_rows=partial)  # fmt: skip
    run_s = time.perf_counter() - start
    bar.close()
    result = ruler_report.summarize(rows, args.min_full_score)
    if cost:
        result["prefill_cost"] = ruler_cost.summarize(cost)
        result["prefill_cost_runs"] = cost
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    settings |= {"grid": grid | {"tasks": tasks, "lengths": lengths, "protocols": protocols}}
    prov = common.bench_provenance(config, settings, load_start)
    prov |= {"generate_s": round(generate_s, 1), "run_s": round(run_s, 1)}
    prov |= {"prefill": prefill_counts(engine.stats, stats_before, cases)}
    files = ruler_report.write(out, rows, result, prov, args.min_full_score)
    columns = ("length", "protocol", "method", "ratio", "macro_score", "ci_low", "ci_high",
               "kv_removed", "vs_full")  # fmt: skip
    print(common.format_table(result["macro"], columns))
    print(f"generated in {generate_s:.0f} s, ran in {run_s:.0f} s")
    print(f"wrote {len(files)} files under {out}")
    return 0


def prefill_counts(after, before, cases) -> dict[str, float]:
    """Prompt tokens the grid computed (added minus prefix-cache hits) and that over the
    cases' prompt tokens: ``prefills_per_sample`` is 1 plus the cells' recomputed tails when
    prefills are shared, the number of requests per sample when not."""
    added = after.num_prompt_tokens - before.num_prompt_tokens
    hit = after.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens
    prompts = sum(len(case.prompt_ids) for case in cases)
    return {
        "prompt_tokens": added,
        "prefix_hit_tokens": hit,
        "computed_prompt_tokens": added - hit,
        "prefills_per_sample": round((added - hit) / prompts, 3) if prompts else 0.0,
    }


def _partial_writer(path: Path):
    """A callback appending rows to ``path`` as JSON lines (partial results of a long run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")

    def write(rows) -> None:
        with path.open("a", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")

    return write


def _prefill_cost(args, config, checkpoint, cases, cells, protocols) -> list[dict]:
    """``--prefill-cost N``: each cell's prefill timed alone on ``N`` samples spread over the
    cases, on an engine of its own with the prefix cache off (freed before the grid)."""
    if args.prefill_cost <= 0:
        return []
    step = max(1, len(cases) // args.prefill_cost)
    picked = list(cases[::step])[: args.prefill_cost]
    cold = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False)
    )
    engine = common.build_engine(cold, checkpoint)
    common.warm_up(engine, engine.vocab_size)
    rows = ruler_cost.prefill_seconds(engine, picked, cells, protocols)
    del engine
    return rows


def report_partial(run_dir: Path, min_full_score: float = 30.0,
                   provenance: dict | None = None) -> list[Path]:  # fmt: skip
    """Reports of a run still going or stopped, from its ``ruler_partial.jsonl`` (the rows of
    every finished stage), written under ``run_dir / "partial"``; ``provenance`` (the run's
    command, date, commit...) is recorded beside the row count.

    Raises:
        ValueError: no finished row yet.
    """
    lines = (Path(run_dir) / "ruler_partial.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    if not rows:
        raise ValueError(f"run_dir: {run_dir} has no finished rows yet")
    result = ruler_report.summarize(rows, min_full_score)
    prov = {"partial": True, "num_rows": len(rows), **(provenance or {})}
    return ruler_report.write(Path(run_dir) / "partial", rows, result, prov, min_full_score)
