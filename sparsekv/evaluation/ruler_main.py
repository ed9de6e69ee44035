"""``sparsekv eval --suite ruler``: flags resolved, the grid run, the reports written."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from sparsekv.bench import common
from sparsekv.cli_args import engine_config_from_args
from sparsekv.evaluation import ruler_report, ruler_run, ruler_tasks, runner

PROTOCOL_CHOICES = ("both", *ruler_run.PROTOCOLS)


def run(args: argparse.Namespace, grid: dict, checkpoint=None) -> int:
    """Run the official RULER tasks for ``grid`` (tasks default to all 13, one length 4096).

    Raises:
        ImportError: the ``ruler`` extra is not installed.
        ValueError: an unknown task, method or protocol.
    """
    load_start = common.load_average()
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    tasks = grid["tasks"] if args.tasks else list(ruler_tasks.load_tasks())
    lengths = grid["lengths"] if args.lengths else [4096]
    protocols = list(ruler_run.PROTOCOLS) if args.protocol == "both" else [args.protocol]
    cells = runner.build_cells(grid["methods"], grid["ratios"], config.compression)
    start = time.perf_counter()
    cases = ruler_run.build_cases(checkpoint.tokenizer, tasks, lengths, grid["samples"],
                                  args.seed, args.prompt_format)  # fmt: skip
    generate_s = time.perf_counter() - start
    engine = common.build_engine(config, checkpoint)
    runs = sum(1 if c.method == "none" else len(protocols) for c in cells)
    work = sum(len(c.prompt_ids) + c.max_tokens for c in cases) * runs
    bar = tqdm(total=work, unit="tok", unit_scale=True, desc="ruler", disable=args.no_progress)
    start = time.perf_counter()
    rows = ruler_run.run(engine, cases, cells, protocols, progress=bar)
    run_s = time.perf_counter() - start
    bar.close()
    result = ruler_report.summarize(rows, args.min_full_score)
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    settings |= {"grid": grid | {"tasks": tasks, "lengths": lengths, "protocols": protocols}}
    prov = common.bench_provenance(config, settings, load_start)
    prov |= {"generate_s": round(generate_s, 1), "run_s": round(run_s, 1)}
    out = Path(args.output_dir)
    files = ruler_report.write(out, rows, result, prov, args.min_full_score)
    columns = ("length", "protocol", "method", "ratio", "macro_score", "ci_low", "ci_high")
    print(common.format_table(result["macro"], columns))
    print(f"generated in {generate_s:.0f} s, ran in {run_s:.0f} s")
    print(f"wrote {len(files)} files under {out}")
    return 0
