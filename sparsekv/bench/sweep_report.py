"""The sweep's report: one row per configuration and level, and the files written from them.

``row_of`` turns a level's ``metrics.Summary`` into its row (latencies in ms);
``write_sweep_report`` writes the JSON, Markdown and throughput plot (``evaluation.report``),
the TTFT plot and the per-request levels file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sparsekv.bench import metrics, serve


def row_of(
    name: str, concurrency: int, summary: metrics.Summary, hit_tokens: float | None = None
) -> dict[str, Any]:
    """The report row of one level (latencies in ms). ``hit_tokens``: prompt tokens served by
    the prefix cache during the level, reported as a fraction of the prompt tokens sent."""
    prompt_tokens = summary.total_input_tokens
    hit_rate = hit_tokens / prompt_tokens if hit_tokens is not None and prompt_tokens else None
    return {
        "config": name,
        "concurrency": concurrency,
        "num_prompts": summary.num_completed + summary.num_failed,
        "failed": summary.num_failed,
        "peak_concurrency": summary.peak_concurrency,
        "req_per_s": summary.request_throughput,
        "output_tok_per_s": summary.output_throughput,
        "total_tok_per_s": summary.total_token_throughput,
        "goodput": summary.goodput,
        "ttft_p50_ms": summary.ttft.p50,
        "ttft_p99_ms": summary.ttft.p99,
        "tpot_p50_ms": summary.tpot.p50,
        "tpot_p99_ms": summary.tpot.p99,
        "itl_p50_ms": summary.itl.p50,
        "itl_p99_ms": summary.itl.p99,
        "e2el_p50_ms": summary.e2el.p50,
        "kv_ratio": summary.mean_kv_compression_ratio,
        "prefix_hit_rate": hit_rate,
    }


def write_sweep_report(
    out: Path, results: dict[str, list[dict]], errors: dict[str, str], settings: dict[str, Any]
) -> dict[str, Any]:
    """JSON + Markdown + throughput PNG (``evaluation.report``), the TTFT PNG, the levels file.

    Raises:
        ValueError: (``configs:``) no configuration produced a level (the errors are in the
            message).
    """
    from sparsekv.evaluation.provenance import provenance
    from sparsekv.evaluation.report import write_line_plot, write_report

    rows = [level["row"] for levels in results.values() for level in levels]
    if not rows:
        raise ValueError(f"configs: no configuration could be measured: {errors}")
    prov = provenance(settings) | {"load_average": list(os.getloadavg()), "errors": errors}
    shape = f"{settings['input_len']} in / {settings['output_len']} out"
    files = write_report(
        out.parent, out.stem, rows,
        title=f"Serving sweep ({settings['dataset']}, {shape}): output tokens/s",
        x="concurrency", y="output_tok_per_s", group="config", provenance=prov,
    )  # fmt: skip
    ttft = out.with_name(f"{out.stem}_ttft.png")
    write_line_plot(
        ttft, rows, title=f"TTFT P50 ({shape})", x="concurrency", y="ttft_p50_ms", group="config"
    )
    with open(files.markdown, "a") as md:
        md.write(f"\n![TTFT P50]({ttft.name})\n")
        for name, message in errors.items():
            md.write(f"\n**{name} failed:** `{message.splitlines()[0]}`\n")
    serve.write_document(
        out.with_name(f"{out.stem}_levels.json"), {"levels": results, "errors": errors}, settings
    )
    return {"rows": rows, "errors": errors, "files": files}
