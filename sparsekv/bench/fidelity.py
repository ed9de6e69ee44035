"""``sparsekv bench fidelity``: how closely each compressed cache follows the full one.

Protocol (docs/benchmarks.md, "Fidelity"): on real long texts found on this machine
(``evaluation.long_texts``: licenses and stdlib sources, >= 3000 tokens), the full cache decodes
a 64-token greedy continuation with its logits; then every (method, ratio) run is teacher-forced
on those tokens with its logits collected. Greedy agreement and mean KL(p_full || p_compressed)
come from ``evaluation.fidelity``. Ratios are ``compression_ratio`` (fraction of the prompt
removed per budgeted layer, no budget); window, pooling, kernel size, GQA aggregation, full
layers and decode eviction come from the usual ``--kv-*`` flags. All full-cache runs go through
one engine first, then all compressed runs together (continuous batching keeps both cores busy).
``--quick``: 4 texts of 1500 tokens, ratios 0.5 and 0.9, methods snapkv, streaming_llm, random.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from sparsekv.bench import common
from sparsekv.bench.arg_types import int_at_least
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.config import COMPRESSION_METHODS, CompressionConfig
from sparsekv.evaluation import ruler_cells
from sparsekv.evaluation.fidelity import fidelity, long_texts
from sparsekv.evaluation.report import write_report
from sparsekv.sampling_params import SamplingParams

ALL_METHODS = tuple(m for m in COMPRESSION_METHODS if m != "none")
# (num_texts, input_len, methods, ratios)
FULL_GRID = (20, 3000, ALL_METHODS, (0.5, 0.75, 0.9))
QUICK_GRID = (4, 1500, ("snapkv", "streaming_llm", "random"), (0.5, 0.9))
COLUMNS = ("method", "ratio", "agreement", "kl", "agreement_min", "compression_ratio", "num_texts")


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench fidelity", __doc__)
    parser.add_argument(
        "--num-texts", type=int_at_least(1), default=None, help="default 20 (quick 4)"
    )
    parser.add_argument(
        "--input-len", type=int_at_least(1), default=None, help="default 3000 (quick 1500)"
    )
    parser.add_argument("--output-len", type=int_at_least(1), default=64, help="compared positions")
    parser.add_argument("--methods", default=None, help="comma list (default: all seven)")
    parser.add_argument("--ratios", default=None, help="comma list (default: 0.5,0.75,0.9)")
    parser.add_argument("--quick", action="store_true", help="a small grid for a first look")
    common.add_common_args(parser, "reports/fidelity.json")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run the grid, print the table and write JSON + Markdown + PNG."""
    args = build_parser().parse_args(argv)
    document = run_fidelity(args, checkpoint=checkpoint)
    print(common.format_table(document["rows"], COLUMNS))
    print(f"wrote {args.output} (+ .md, .png, _texts.json)")
    return 0


def grid(
    args: argparse.Namespace, base: CompressionConfig
) -> list[tuple[str, float, CompressionConfig]]:
    """``[(method, ratio, policy)]`` of the compressed runs; ``none`` runs once at ratio 0. A
    method may carry its own settings (``method:key=value``, ``ruler_cells.grid_cells``).

    Raises:
        ValueError: an unknown method or setting, or a ratio outside [0, 1).
    """
    defaults = QUICK_GRID if args.quick else FULL_GRID
    methods = args.methods.split(",") if args.methods else list(defaults[2])
    ratios = [float(r) for r in args.ratios.split(",")] if args.ratios else list(defaults[3])
    cells = ruler_cells.grid_cells([m.strip() for m in methods], ratios, base)
    return [(cell.method, cell.ratio, cell.policy) for cell in cells]


def run_fidelity(args: argparse.Namespace, checkpoint=None) -> dict:
    """Full-cache runs, then every grid cell teacher-forced; aggregate and write reports.

    Returns:
        ``{"rows", "texts", "provenance"}``: one row per (method, ratio) with mean agreement,
        mean KL (nats), the worst text's agreement and the mean effective compression ratio.

    Raises:
        ValueError: no long text of ``--input-len`` tokens exists on this machine, or an
            invalid grid.
    """
    common.apply_threads(args.threads)
    load_start = common.load_average()
    defaults = QUICK_GRID if args.quick else FULL_GRID
    num_texts = defaults[0] if args.num_texts is None else args.num_texts
    input_len = defaults[1] if args.input_len is None else args.input_len
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    cells = grid(args, config.compression)
    texts = long_texts(checkpoint.tokenizer, min_tokens=input_len, count=num_texts)
    if not texts:
        raise ValueError(f"input_len: no text of {input_len} tokens found on this machine")
    prompts = {
        name: checkpoint.tokenizer.encode(text, add_special_tokens=False)[:input_len]
        for name, text in texts
    }
    engine = common.build_engine(config, checkpoint)
    common.warm_up(engine, checkpoint.hf_config.vocab_size)
    work = sum(len(p) + args.output_len for p in prompts.values()) * (1 + len(cells))
    bar = tqdm(total=work, unit="tok", unit_scale=True, desc="fidelity", disable=args.no_progress)
    references = full_runs(engine, prompts, args.output_len, bar)
    per_text = compressed_runs(engine, prompts, cells, references, bar)
    bar.close()
    rows = aggregate(per_text, cells)
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    settings |= {"num_texts": len(texts), "input_len": input_len, "texts": list(prompts)}
    prov = common.bench_provenance(config, settings, load_start)
    path = Path(args.output)
    title = f"Fidelity to the full cache: {len(texts)} texts x {input_len} tokens, 64 forced"
    write_report(
        path.parent,
        path.stem,
        rows,
        title=title,
        x="ratio",
        y="agreement",
        group="method",
        provenance=prov,
    )
    common.write_json(path.with_name(path.stem + "_texts.json"), {"rows": per_text})
    return {"rows": rows, "texts": per_text, "provenance": prov}


def full_runs(engine, prompts: dict[str, list[int]], output_len: int, bar) -> dict:
    """Greedy full-cache continuations: text name -> (tokens ``[T]``, logits ``[T, V]`` fp32)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    requests = [
        common.BenchRequest(name, ids, params, CompressionConfig(method="none"), None, True)
        for name, ids in prompts.items()
    ]
    references = {}

    def keep(output, request):
        references[output.request_id] = (
            list(output.outputs[0].token_ids),
            torch.stack(request.logits),
        )
        request.logits = []

    common.run_requests(engine, requests, on_finish=keep, progress=bar)
    return references


def compressed_runs(engine, prompts, cells, references, bar) -> list[dict]:
    """Every (text, cell) teacher-forced on the reference tokens; one result row each.

    Logits are compared as each request finishes and then dropped, so memory stays at the
    running requests' logits only.
    """
    requests, keys = [], {}
    for name, ids in prompts.items():
        tokens = references[name][0]
        params = SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True)
        for index, (method, ratio, policy) in enumerate(cells):
            request_id = f"{name}|{index}"
            keys[request_id] = (name, method, ratio)
            requests.append(common.BenchRequest(request_id, ids, params, policy, tokens, True))
    results = []

    def compare(output, request):
        name, method, ratio = keys[output.request_id]
        tokens, full_logits = references[name]
        result = fidelity(tokens, full_logits, torch.stack(request.logits))
        request.logits = []
        stats = output.kv_stats
        results.append(
            {
                "text": name,
                "method": method,
                "ratio": ratio,
                "agreement": result.agreement,
                "kl": result.kl,
                "first_divergence": result.first_divergence,
                "compression_ratio": stats.compression_ratio if stats else 0.0,
            }
        )

    common.run_requests(engine, requests, on_finish=compare, progress=bar)
    return results


def aggregate(per_text: list[dict], cells) -> list[dict]:
    """One row per (method, ratio), in grid order: means over texts, worst agreement."""
    rows = []
    for method, ratio, _ in cells:
        group = [r for r in per_text if r["method"] == method and r["ratio"] == ratio]
        rows.append(
            {
                "method": method,
                "ratio": ratio,
                "agreement": statistics.fmean(r["agreement"] for r in group),
                "kl": statistics.fmean(r["kl"] for r in group),
                "agreement_min": min(r["agreement"] for r in group),
                "compression_ratio": statistics.fmean(r["compression_ratio"] for r in group),
                "num_texts": len(group),
            }
        )
    return rows
