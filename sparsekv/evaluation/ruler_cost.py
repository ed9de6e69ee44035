"""Prefill cost of each RULER cell: its time to first token alone on an idle engine.

A shared-prefill grid hides what each method's prefill costs (the cells attach one prefill), so
the cost is measured apart: every (cell, protocol) of the first samples runs alone, cold (the
engine's prefix cache off), with ``max_tokens = 1``, and its time to first token (prefill,
compression and, for KVzip, the reconstruction pass) is taken from the output's metrics. The
summary gives each cell's median and its ratio to SnapKV's at the same ratio and protocol.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from sparsekv.evaluation.ruler_run import PROTOCOLS, RulerCase, policy_of
from sparsekv.evaluation.runner import Cell
from sparsekv.sampling_params import SamplingParams

REFERENCE = "snapkv"


def prefill_seconds(engine, cases: Sequence[RulerCase], cells: Sequence[Cell],
                    protocols: Sequence[str]) -> list[dict[str, Any]]:  # fmt: skip
    """Time to first token of every (case, cell, protocol), one request at a time.

    Args:
        engine: an idle engine with its prefix cache off (a hit would skip the prefill).

    Returns:
        One row per run: task, sample, method, ratio, protocol, num_prompt_tokens, prefill_s.

    Raises:
        ValueError: the engine's prefix cache is on.
    """
    from sparsekv.bench.common import BenchRequest, run_requests

    if engine.kv.prefix_cache is not None:
        raise ValueError("engine: prefill cost needs the prefix cache off")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for index, case in enumerate(cases):
        for cell in cells:
            for protocol in PROTOCOLS[:1] if cell.method == "none" else protocols:
                request_id = f"cost|{index}|{cell.method}|{cell.ratio}|{protocol}"
                policy = policy_of(cell, case, protocol)
                request = BenchRequest(request_id, case.prompt_ids, params, policy)
                outputs, _ = run_requests(engine, [request])
                metrics = outputs[request_id].metrics
                rows.append(
                    {
                        "task": case.sample.task,
                        "sample": case.sample.index,
                        "method": cell.method,
                        "ratio": cell.ratio,
                        "protocol": "both" if cell.method == "none" else protocol,
                        "num_prompt_tokens": len(case.prompt_ids),
                        "prefill_s": metrics["first_token"] - metrics["arrival"],
                    }
                )
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median prefill seconds per (method, ratio, protocol) and its ratio to SnapKV's median
    at the same ratio and protocol (``None`` where SnapKV was not run)."""
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        key = (row["method"], row["ratio"], row["protocol"])
        groups.setdefault(key, []).append(row["prefill_s"])
    medians = {key: statistics.median(values) for key, values in groups.items()}
    out = []
    for (method, ratio, protocol), median in medians.items():
        reference = medians.get((REFERENCE, ratio, protocol))
        if method == "none":
            references = [v for (m, _, _), v in medians.items() if m == REFERENCE]
            reference = statistics.median(references) if references else None
        out.append(
            {
                "method": method,
                "ratio": ratio,
                "protocol": protocol,
                "prefill_s": round(median, 3),
                "vs_snapkv": round(median / reference, 3) if reference else None,
                "num_runs": len(groups[(method, ratio, protocol)]),
            }
        )
    return out
