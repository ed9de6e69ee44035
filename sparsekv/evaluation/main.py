"""``sparsekv eval``: long-context accuracy of each compression method, offline.

Runs RULER-style tasks (arXiv 2404.06654) at the given lengths through the offline engine, for
``none`` (full cache) and every method x compression ratio, and writes under ``--output-dir``:

* ``eval.json`` / ``eval.csv`` / ``eval.md``: mean score (0-100) per task, length, method and
  ratio, with provenance; ``eval_samples.csv`` / ``.json``: every answer and its score;
* ``eval_<task>.png``: score vs compression ratio, one line per method (the full cache's score
  is each line's point at ratio 0);
* ``eval_heatmap_<method>_r<ratio>.png``: retrieval accuracy by needle depth x length.

``--quick``: passkey and niah_single at 1024 tokens, 2 samples, none and snapkv at 0.75 (a
couple of minutes on SmolLM2). ``--fidelity`` also runs ``sparsekv bench fidelity`` (greedy
agreement and KL vs the full cache) into the same folder, when that bench is installed.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from sparsekv.bench import common
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.evaluation import ruler_cells, runner
from sparsekv.evaluation.report import markdown_table, write_heatmap, write_line_plot

# tasks, lengths, samples, methods, ratios
FULL_PRESET = ("niah_single,passkey", "4096,8192", 5, "none,snapkv", "0.5,0.75,0.9")
QUICK_PRESET = ("passkey,niah_single", "1024", 2, "none,snapkv", "0.75")


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv eval", __doc__)
    parser.add_argument("--tasks", default=None, help="comma list (default niah_single,passkey)")
    parser.add_argument("--lengths", default=None, help="tokens, comma list (default 4096,8192)")
    parser.add_argument(
        "--methods", default=None,
        help="comma list (default none,snapkv); a method may carry its own settings, "
        "method:key=value[:key=value] (e.g. snapkv:head_budgets=adaptive)",
    )  # fmt: skip
    parser.add_argument("--ratios", default=None, help="comma list (default 0.5,0.75,0.9)")
    parser.add_argument("--samples", type=int, default=None, help="per task, length, depth (5)")
    parser.add_argument("--depths", default=None, help="needle grid, comma list in [0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--answer-margin", type=int, default=32,
        help="max_tokens = answer tokens + this; room for the preamble models write first "
        "(\"The special magic numbers for X are: ...\" is ~20 tokens)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-format",
        choices=runner.PROMPT_FORMATS,
        default="chat",
        help="chat: chat template + answer prefix; chat-plain: the question as a plain chat "
        "user message, no answer prefix; completion: plain text ending in the answer "
        "prefix (base models, e.g. gemma3-270m)",
    )
    parser.add_argument(
        "--suite", choices=("builtin", "ruler"), default="builtin",
        help="builtin: sparsekv's RULER-style generators; ruler: the official 13 RULER tasks "
        "from nvidia-long-context-eval (the `ruler` extra; tasks default to all 13, length 4096)",
    )  # fmt: skip
    parser.add_argument(
        "--protocol", choices=("both", "aware", "agnostic"), default="both",
        help="--suite ruler: aware = whole prompt compressed (question in the window); "
        "agnostic = context compressed with scope context, question after",
    )  # fmt: skip
    parser.add_argument(
        "--min-full-score", type=float, default=30.0,
        help="--suite ruler: macro score over tasks the full cache scores at least this on",
    )  # fmt: skip
    parser.add_argument(
        "--share-group", type=int, default=2,
        help="--suite ruler: one prefill per sample serves all its cells (prefix cache), this "
        "many samples a stage; 0 = every request prefills its own prompt",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-cost", type=int, default=0,
        help="--suite ruler: also time every cell's prefill alone (cold, max_tokens 1) on this "
        "many samples spread over the tasks, before the grid",
    )  # fmt: skip
    parser.add_argument("--output-dir", default="reports/eval")
    parser.add_argument("--quick", action="store_true", help="a couple of minutes on SmolLM2")
    parser.add_argument("--fidelity", action="store_true", help="also run bench fidelity")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    add_engine_args(parser)
    return parser


def _split(text: str, kind=str) -> list:
    try:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError as exc:
        raise ValueError(f"cannot parse {text!r}: {exc}") from None


def resolve_grid(args: argparse.Namespace) -> dict[str, Any]:
    """The grid after the preset's defaults (``--quick`` or full) are filled in."""
    tasks, lengths, samples, methods, ratios = QUICK_PRESET if args.quick else FULL_PRESET

    # A flag given (even empty or 0) replaces the preset: only an absent one takes its value.
    def given(value, preset):
        return preset if value is None else value

    grid = {
        "tasks": _split(given(args.tasks, tasks)),
        "lengths": _split(given(args.lengths, lengths), int),
        "samples": given(args.samples, samples),
        "methods": _split(given(args.methods, methods)),
        "ratios": _split(given(args.ratios, ratios), float),
        "depths": _split(args.depths, float) if args.depths else None,
    }
    if grid["samples"] < 1 or not grid["lengths"] or min(grid["lengths"]) < 1:
        raise ValueError("samples and lengths must be >= 1")
    for name in ("tasks", "methods", "ratios"):
        if not grid[name]:
            raise ValueError(f"{name}: the list is empty")
    return grid


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run the grid, write the reports; then the fidelity bench if asked."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # ``sparsekv eval -- --quick``: the top-level parser keeps the --
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    common.apply_threads(args.threads)
    grid = resolve_grid(args)
    if args.suite == "ruler":
        from sparsekv.evaluation import ruler_main

        return ruler_main.run(args, grid, checkpoint)
    load_start = common.load_average()
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    cells = ruler_cells.grid_cells(grid["methods"], grid["ratios"], config.compression)
    cases = runner.build_cases(
        checkpoint.tokenizer, grid["tasks"], grid["lengths"], grid["samples"], grid["depths"],
        args.seed, args.prompt_format,
    )  # fmt: skip
    engine = common.build_engine(config, checkpoint)
    work = sum(
        len(c.prompt_ids) + runner.max_answer_tokens(c.sample, args.answer_margin) for c in cases
    )
    bar = tqdm(total=work * len(cells), unit="tok", unit_scale=True, desc="eval",
               disable=args.no_progress)  # fmt: skip
    rows = runner.run_grid(engine, cases, cells, args.answer_margin, progress=bar)
    bar.close()
    summary = runner.summarize(rows)
    settings = {k: v for k, v in vars(args).items() if "__" not in k} | {"grid": grid}
    prov = common.bench_provenance(config, settings, load_start)
    files = write_reports(Path(args.output_dir), rows, summary, prov)
    columns = ("task", "length", "method", "ratio", "score", "compression_ratio", "num_samples")
    print(common.format_table(summary, columns))
    print(f"wrote {len(files)} files under {args.output_dir}")
    if args.fidelity:
        return run_fidelity(args, grid, checkpoint)
    return 0


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot_rows(summary: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """Points of one task's score-vs-ratio plot: one series per method (and length when
    several), each starting from the full cache's score at ratio 0 when it was run."""
    rows = [r for r in summary if r["task"] == task]
    lengths = sorted({r["length"] for r in rows})
    points = []
    for row in rows:
        if row["method"] == "none":
            continue
        series = row["method"] if len(lengths) == 1 else f"{row['method']}@{row['length']}"
        points.append({"series": series, "ratio": row["ratio"], "score": row["score"]})
        base = [r for r in rows if r["method"] == "none" and r["length"] == row["length"]]
        if base and not any(p["series"] == series and p["ratio"] == 0.0 for p in points):
            points.append({"series": series, "ratio": 0.0, "score": base[0]["score"]})
    if not points:  # only the full cache was run
        points = [{"series": "none", "ratio": 0.0, "score": r["score"]} for r in rows]
    return points


def write_reports(
    out: Path, rows: list[dict[str, Any]], summary: list[dict[str, Any]], prov: dict[str, Any]
) -> list[Path]:
    """CSV / JSON / Markdown tables, a score-vs-ratio plot per task, a needle heatmap per
    compression cell (retrieval tasks only); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    files = [_write_csv(out / "eval.csv", summary), _write_csv(out / "eval_samples.csv", rows)]
    files.append(common.write_json(out / "eval.json", {"rows": summary, "provenance": prov}))
    files.append(common.write_json(out / "eval_samples.json", {"rows": rows}))
    images = []
    for task in dict.fromkeys(r["task"] for r in summary):
        path = out / f"eval_{task}.png"
        title = f"{task}: score vs compression ratio"
        images.append(
            write_line_plot(path, plot_rows(summary, task), title=title, x="ratio", y="score",
                            group="series")
        )  # fmt: skip
    needles = [r for r in rows if r["depth"] is not None]
    for method, ratio in dict.fromkeys((r["method"], r["ratio"]) for r in needles):
        cell = [r for r in needles if r["method"] == method and r["ratio"] == ratio]
        # A method entry may carry settings (``snapkv:head_budgets=adaptive``): file-safe name.
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", method)
        path = out / f"eval_heatmap_{name}_r{ratio:g}.png"
        title = f"{method} (ratio {ratio:g}): retrieval score by depth x length"
        images.append(write_heatmap(path, cell, title=title))
    facts = "\n".join(f"- {k}: `{json.dumps(v, default=str)}`" for k, v in prov.items())
    figures = "\n\n".join(f"![{p.stem}]({p.name})" for p in images)
    markdown = out / "eval.md"
    markdown.write_text(
        f"# Long-context accuracy (score 0-100)\n\n{markdown_table(summary)}\n\n{figures}\n\n"
        f"## Provenance\n\n{facts}\n"
    )
    return files + images + [markdown]


def run_fidelity(args: argparse.Namespace, grid: dict[str, Any], checkpoint) -> int:
    """Delegate to ``sparsekv bench fidelity`` with this run's model, grid and folder."""
    try:
        from sparsekv.bench import fidelity
    except ImportError:
        print("fidelity: sparsekv.bench.fidelity is not available; skipped")
        return 0
    argv = ["--output", str(Path(args.output_dir) / "fidelity.json")]
    argv += ["--model", args.model__model, "--dtype", args.model__dtype]
    argv += ["--methods", ",".join(m for m in grid["methods"] if m != "none") or "snapkv"]
    argv += ["--ratios", ",".join(str(r) for r in grid["ratios"])]
    argv += ["--kv-window", str(args.compression__window)]
    argv += ["--kv-full-layers", str(args.compression__full_layers)]
    argv += ["--quick"] if args.quick else []
    argv += ["--threads", str(args.threads)] if args.threads else []
    argv += ["--no-progress"] if args.no_progress else []
    return fidelity.main(argv, checkpoint=checkpoint)


if __name__ == "__main__":
    sys.exit(main())
