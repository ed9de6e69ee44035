"""``sparsekv bench compression``: full cache vs compressed caches, side by side, one engine.

Shape S2 (docs/benchmarks.md): 20 requests x 4000 random prompt tokens / 256 output tokens under a
1 GiB KV pool, submitted at once, once per policy: the full cache, then each ``--methods`` entry
(default: the ``--kv-compression`` method, snapkv) with ``--kv-budget`` (default 512 here) and
``--kv-full-layers`` (default 2). A compressed request holds fewer pages, so more requests run
at once and fewer are preempted. ``--quick`` runs 6 x 1500 / 64 under a pool of 2.5 full-cache
requests. Reported per policy: output and total tokens/s, TTFT P50/P90, peak running requests,
preemptions, peak pages and the effective compression ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from sparsekv.bench import common
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.config import CompressionConfig, EngineConfig
from sparsekv.evaluation.report import write_report
from sparsekv.sampling_params import SamplingParams

SHAPES = {"s2": (20, 4000, 256), "quick": (6, 1500, 64)}
# --quick pool: room for this many full-cache requests at their peak, so they queue.
QUICK_POOL_REQUESTS = 2.5

COLUMNS = (
    "policy",
    "output_tok_s",
    "total_tok_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "peak_running",
    "num_preemptions",
    "peak_pages_used",
    "pages_total",
    "compression_ratio",
    "wall_s",
)


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench compression", __doc__)
    parser.add_argument("--num-prompts", type=int, default=None, help="default 20 (quick 6)")
    parser.add_argument("--input-len", type=int, default=None, help="default 4000 (quick 1500)")
    parser.add_argument("--output-len", type=int, default=None, help="default 256 (quick 64)")
    parser.add_argument(
        "--methods",
        default=None,
        help="comma list of policies to run after the full cache (default: --kv-compression; "
        "e.g. snapkv,pyramidkv: pyramidkv treats --kv-budget as the average)",
    )
    parser.add_argument("--quick", action="store_true", help="6 x 1500 / 64, small pool")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    common.add_common_args(parser, "reports/compression.json")
    add_engine_args(parser)
    parser.set_defaults(cache__kv_cache_memory=1.0, compression__budget=512)
    return parser


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run every policy, print a table and write JSON + Markdown + PNG."""
    args = build_parser().parse_args(argv)
    document = run_compression(args, checkpoint=checkpoint)
    print(common.format_table(document["rows"], COLUMNS))
    for line in document["notes"]:
        print(line)
    print(f"wrote {args.output} (+ .md, .png)")
    return 0


def policies(
    args: argparse.Namespace, base: CompressionConfig
) -> list[tuple[str, CompressionConfig]]:
    """``[(label, policy)]``: the full cache first, then each method over the base policy."""
    names = args.methods.split(",") if args.methods else [base.method]
    result = [("full", CompressionConfig(method="none"))]
    for name in (n.strip() for n in names):
        if name in ("", "none"):
            continue
        policy = dataclasses.replace(base, method=name)
        policy.validate()
        size = f"r{policy.compression_ratio}" if policy.budget is None else f"b{policy.budget}"
        result.append((f"{name}-{size}", policy))
    return result


def run_compression(args: argparse.Namespace, checkpoint=None) -> dict:
    """Run the workload once per policy on one engine and write the report.

    Returns:
        ``{"rows", "notes", "provenance"}`` as written to ``args.output``.

    Raises:
        ValueError: an invalid policy, or a request larger than the whole pool.
    """
    common.apply_threads(args.threads)
    load_start = common.load_average()
    shape = SHAPES["quick" if args.quick else "s2"]
    num_prompts = args.num_prompts or shape[0]
    input_len = args.input_len or shape[1]
    output_len = args.output_len or shape[2]
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    if args.quick and config.cache.num_pages is None:
        config = _with_quick_pool(config, checkpoint.hf_config, input_len + output_len)
    runs = policies(args, config.compression)
    engine = common.build_engine(config, checkpoint)
    vocab_size = checkpoint.hf_config.vocab_size
    common.warm_up(engine, vocab_size)
    avoid = common.special_token_ids(checkpoint.tokenizer)
    prompts = common.random_prompts(num_prompts, input_len, vocab_size, args.seed, avoid)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for label, policy in runs:
        print(f"running {label}: {num_prompts} x {input_len} / {output_len}", flush=True)
        rows.append(run_policy(engine, label, policy, prompts, params, not args.no_progress))
        common.write_json(args.output, {"rows": rows, "partial": True})  # survives a crash
    notes = _notes(rows)
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    settings |= {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len}
    prov = common.bench_provenance(config, settings, load_start)
    prov["notes"] = notes
    path = Path(args.output)
    write_report(
        path.parent,
        path.stem,
        rows,
        title=f"Full vs compressed KV: {num_prompts} x {input_len} / {output_len}",
        x="policy",
        y="output_tok_s",
        provenance=prov,
    )
    return {"rows": rows, "notes": notes, "provenance": prov}


def run_policy(
    engine, label: str, policy: CompressionConfig, prompts, params, show_progress: bool = False
) -> dict:
    """One policy's row: the whole batch submitted at once, run to the end."""
    requests = [
        common.BenchRequest(f"{label}-{i}", p, params, policy) for i, p in enumerate(prompts)
    ]
    bar = common.progress_bar(requests, label, disable=not show_progress)
    outputs, trace = common.run_requests(engine, requests, progress=bar)
    bar.close()
    ordered = [outputs[r.request_id] for r in requests]
    num_output = sum(len(o.outputs[0].token_ids) for o in ordered)
    num_prompt = sum(len(p) for p in prompts)
    ttfts = [common.ttft_s(o) for o in ordered]
    ratios = [o.kv_stats.compression_ratio for o in ordered if o.kv_stats is not None]
    return {
        "policy": label,
        "method": policy.method,
        "budget": policy.budget if policy.enabled else None,
        "full_layers": policy.full_layers if policy.enabled else None,
        "num_requests": len(prompts),
        "output_tokens": num_output,
        "output_tok_s": num_output / trace.wall_s,
        "total_tok_s": (num_prompt + num_output) / trace.wall_s,
        "ttft_p50_s": common.percentile(ttfts, 50),
        "ttft_p90_s": common.percentile(ttfts, 90),
        "peak_running": trace.peak_running,
        "num_preemptions": trace.num_preemptions,
        "peak_pages_used": trace.peak_pages_used,
        "pages_total": trace.pages_total,
        "compression_ratio": sum(ratios) / len(ratios) if ratios else 0.0,
        "wall_s": trace.wall_s,
        "num_steps": trace.num_steps,
    }


def _with_quick_pool(config: EngineConfig, hf_config, num_tokens: int) -> EngineConfig:
    """A copy of ``config`` whose pool holds ``QUICK_POOL_REQUESTS`` full-cache requests."""
    block = config.cache.block_size
    per_request = hf_config.num_hidden_layers * math.ceil(num_tokens / block)
    cache = dataclasses.replace(
        config.cache, num_pages=math.ceil(QUICK_POOL_REQUESTS * per_request)
    )
    return dataclasses.replace(config, cache=cache)


def _notes(rows: list[dict]) -> list[str]:
    full = rows[0]
    notes = []
    for row in rows[1:]:
        speedup = row["output_tok_s"] / full["output_tok_s"]
        notes.append(
            f"{row['policy']}: {speedup:.2f}x the full cache's output tokens/s, "
            f"{row['peak_running']} vs {full['peak_running']} requests running at peak, "
            f"effective compression ratio {row['compression_ratio']:.3f}"
        )
    return notes
