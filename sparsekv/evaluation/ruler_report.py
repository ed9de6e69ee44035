"""Reports of ``sparsekv eval --suite ruler``: JSON, CSV, Markdown tables and macro plots.

Files under the output folder:

* ``ruler.json``: per-task summary, macro scores, the tasks kept in / left out of the macro
  score per length, provenance; ``ruler_samples.csv`` / ``.json``: every answer and its score;
* ``ruler.md``: macro table, per-task table with 95% bootstrap intervals, left-out tasks;
* ``ruler_macro_<protocol>_<length>.png``: macro score vs compression ratio, one line per
  method (the full cache's score as each line's point at ratio 0).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparsekv.bench import common
from sparsekv.evaluation import ruler_stats
from sparsekv.evaluation.report import markdown_table, write_line_plot


def summarize(rows: Sequence[dict[str, Any]], min_full_score: float) -> dict[str, Any]:
    """Per-task summary, macro rows and the tasks in / out of the macro score per length."""
    summary = ruler_stats.task_summary(rows)
    macro, included, excluded = [], {}, {}
    for length in dict.fromkeys(r["length"] for r in rows):
        solved = ruler_stats.solved_tasks(summary, length, min_full_score)
        included[length] = solved
        tasks = dict.fromkeys(r["task"] for r in rows if r["length"] == length)
        excluded[length] = [t for t in tasks if t not in solved]
        macro += ruler_stats.macro_summary(rows, solved, length)
    ruler_stats.add_effective(macro, rows)
    return {"tasks": summary, "macro": macro, "included": included, "excluded": excluded}


def macro_points(macro: Sequence[dict[str, Any]], protocol: str, length: int) -> list[dict]:
    """One series per compressing method, starting from the full cache at ratio 0."""
    rows = [r for r in macro if r["protocol"] == protocol and r["length"] == length]
    full = [r["macro_score"] for r in rows if r["method"] == "none"]
    points = []
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "none"):
        points += [{"method": method, "ratio": 0.0, "macro_score": s} for s in full]
        points += [
            {"method": method, "ratio": r["ratio"], "macro_score": r["macro_score"]}
            for r in rows
            if r["method"] == method
        ]
    return points


def write(out: Path, rows: list[dict[str, Any]], result: dict[str, Any],
          prov: dict[str, Any], min_full_score: float) -> list[Path]:  # fmt: skip
    """Write every file of the module docstring; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = [common.write_json(out / "ruler.json", {**result, "provenance": prov})]
    files.append(common.write_json(out / "ruler_samples.json", {"rows": rows}))
    with open(out / "ruler_samples.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    files.append(out / "ruler_samples.csv")
    images = []
    for length, protocol in dict.fromkeys((r["length"], r["protocol"]) for r in result["macro"]):
        points = macro_points(result["macro"], protocol, length)
        if points:
            path = out / f"ruler_macro_{protocol}_{length}.png"
            title = f"RULER {length} tokens, query-{protocol}: macro score vs ratio removed"
            images.append(write_line_plot(path, points, title=title, x="ratio",
                                          y="macro_score", group="method"))  # fmt: skip
    excluded = "\n".join(
        f"- {length} tokens: {', '.join(tasks) or 'none'}"
        for length, tasks in result["excluded"].items()
    )
    facts = "\n".join(f"- {k}: `{json.dumps(v, default=str)}`" for k, v in prov.items())
    figures = "\n\n".join(f"![{p.stem}]({p.name})" for p in images)
    cost = ""
    if result.get("prefill_cost"):
        cost = (
            "## Prefill cost (time to first token alone, cold; median; relative to SnapKV)\n\n"
            f"{markdown_table(result['prefill_cost'])}\n\n"
        )
    (out / "ruler.md").write_text(
        "# RULER (official tasks), score 0-100\n\n"
        f"## Macro score over the tasks the full cache scores >= {min_full_score:g} on\n\n"
        f"{markdown_table(result['macro'])}\n\n{figures}\n\n"
        f"## Left out of the macro score (full cache below {min_full_score:g})\n\n{excluded}\n\n"
        f"## Per task (95% bootstrap intervals over samples)\n\n"
        f"{markdown_table(result['tasks'])}\n\n{cost}## Provenance\n\n{facts}\n"
    )
    return files + images + [out / "ruler.md"]
