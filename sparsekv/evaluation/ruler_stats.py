"""RULER aggregates: per-task means with bootstrap intervals, and the macro score.

Per task, a cell's score is the mean of its samples' scores (RULER's string match, 0-100). The
macro score of a cell averages its tasks, as kvpress's RULER board does, over the tasks the
full cache solves on this model (full-cache score ``>= min_full_score``, 30 by default): a task
the model fails even uncompressed says nothing about compression; those are reported apart.
Intervals are 95% percentile bootstraps over samples (resampled within each task for the macro
score), with a fixed seed.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

NUM_RESAMPLES = 1000


def bootstrap_interval(scores: Sequence[float], seed: int = 0,
                       num_resamples: int = NUM_RESAMPLES) -> tuple[float, float]:  # fmt: skip
    """95% percentile bootstrap interval of the mean of ``scores``.

    Raises:
        ValueError: no scores.
    """
    if not scores:
        raise ValueError("bootstrap_interval needs at least one score")
    rng = random.Random(seed)
    n = len(scores)
    means = sorted(statistics.fmean(rng.choices(scores, k=n)) for _ in range(num_resamples))
    return means[int(0.025 * num_resamples)], means[int(0.975 * num_resamples) - 1]


def task_summary(rows: Sequence[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Mean score, bootstrap interval and effective ratio per (task, length, protocol, method,
    ratio), in the order the groups first appear."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["task"], row["length"], row["protocol"], row["method"], row["ratio"])
        groups.setdefault(key, []).append(row)
    summary = []
    for (task, length, protocol, method, ratio), group in groups.items():
        scores = [r["score"] for r in group]
        low, high = bootstrap_interval(scores, seed)
        summary.append(
            {
                "task": task,
                "length": length,
                "protocol": protocol,
                "method": method,
                "ratio": ratio,
                "score": statistics.fmean(scores),
                "ci_low": low,
                "ci_high": high,
                "compression_ratio": statistics.fmean(r["compression_ratio"] for r in group),
                "num_samples": len(group),
            }
        )
    return summary


def solved_tasks(summary: Sequence[dict[str, Any]], length: int,
                 min_full_score: float = 30.0) -> list[str]:  # fmt: skip
    """Tasks whose full-cache (method ``none``) score at ``length`` is at least
    ``min_full_score`` (once each, in order)."""
    solved = [
        r["task"]
        for r in summary
        if r["method"] == "none" and r["length"] == length and r["score"] >= min_full_score
    ]
    return list(dict.fromkeys(solved))


def macro_summary(rows: Sequence[dict[str, Any]], tasks: Sequence[str], length: int,
                  seed: int = 0, num_resamples: int = NUM_RESAMPLES) -> list[dict[str, Any]]:  # fmt: skip
    """Macro score (mean over ``tasks`` of each task's mean) at ``length`` per (protocol,
    method, ratio), with a bootstrap interval that resamples each task's samples.

    Cells missing a task of ``tasks`` are left out. Empty ``tasks``: no rows.
    """
    cells: dict[tuple, dict[str, list[float]]] = {}
    for row in rows:
        if row["task"] in tasks and row["length"] == length:
            key = (row["protocol"], row["method"], row["ratio"])
            cells.setdefault(key, {}).setdefault(row["task"], []).append(row["score"])
    out = []
    for (protocol, method, ratio), by_task in cells.items():
        if set(by_task) != set(tasks):
            continue
        per_task = [by_task[t] for t in tasks]
        rng = random.Random(seed)
        resampled = sorted(
            statistics.fmean(statistics.fmean(rng.choices(s, k=len(s))) for s in per_task)
            for _ in range(num_resamples)
        )
        out.append(
            {
                "length": length,
                "protocol": protocol,
                "method": method,
                "ratio": ratio,
                "macro_score": statistics.fmean(statistics.fmean(s) for s in per_task),
                "ci_low": resampled[int(0.025 * num_resamples)],
                "ci_high": resampled[int(0.975 * num_resamples) - 1],
                "num_tasks": len(tasks),
            }
        )
    return out


def add_effective(macro: list[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> None:
    """Add to each macro row ``kv_removed``, the whole-model share of the full cache's slots
    the cell no longer holds (``1 - kept / kept of the full cache`` on the same sample, slots
    averaged over layers, sliding windows counted in both: on a model whose ratio applies to a
    few global layers it is far below the nominal ratio), and ``vs_full``, the macro score
    over the full cache's at the same length and protocol. Rows without ``kv_tokens_kept``
    give no ``kv_removed``."""
    full_kept = {
        (r["task"], r["length"], r["sample"]): r["kv_tokens_kept"]
        for r in rows
        if r["method"] == "none" and r.get("kv_tokens_kept")
    }
    removed: dict[tuple, list[float]] = {}
    for r in rows:
        full = full_kept.get((r["task"], r["length"], r["sample"]))
        if full and "kv_tokens_kept" in r:
            key = (r["length"], r["protocol"], r["method"], r["ratio"])
            removed.setdefault(key, []).append(1 - r["kv_tokens_kept"] / full)
    full_macro = {
        (m["length"], m["protocol"]): m["macro_score"] for m in macro if m["method"] == "none"
    }
    for m in macro:
        values = removed.get((m["length"], m["protocol"], m["method"], m["ratio"]))
        if values:
            m["kv_removed"] = round(statistics.fmean(values), 4)
        full = full_macro.get((m["length"], m["protocol"]))
        if full:
            m["vs_full"] = round(m["macro_score"] / full, 4)
