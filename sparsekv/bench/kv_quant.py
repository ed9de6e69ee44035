"""``sparsekv bench kv-quant``: KV-cache formats side by side: memory, speed and fidelity.

Each cell is a page format, optionally with a compression policy: ``auto`` (the model dtype),
``int8``, ``fp8``, ``int4`` and ``int8+snapkv@0.75`` by default (``FORMAT[+METHOD@RATIO]``,
ratio = fraction of the prompt removed per budgeted layer). Per cell, on one engine of that
format (the same checkpoint):

1. **memory**: stored KV bytes per token over all layers (codes and scales), tokens that fit
   per GiB of pool, and, with compression, prompt tokens per GiB at the measured ratio;
2. **speed**: ``--num-prompts`` random prompts of ``--input-len`` tokens / ``--output-len``
   greedy tokens submitted at once under ``--kv-cache-memory`` GiB (default 20 x 4000 / 256 in
   1 GiB): output tokens/s, TTFT P50, peak running requests, preemptions;
3. **fidelity** (greedy agreement and KL, docs/benchmarks.md): on ``--num-texts`` real long texts, the full-precision,
   uncompressed cache decodes 64 greedy tokens; each cell is teacher-forced on them: greedy
   agreement and KL(p_full || p_cell).

``--quick``: 6 x 1500 / 64 and 3 texts of 1000 tokens. ``--skip-speed`` / ``--skip-fidelity``
run one half. Reports: JSON + Markdown + PNG at ``--output``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
from pathlib import Path

from tqdm import tqdm

from sparsekv.bench import common
from sparsekv.bench.compression import run_policy
from sparsekv.bench.fidelity import compressed_runs, full_runs
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.config import CompressionConfig, EngineConfig
from sparsekv.evaluation.fidelity import long_texts
from sparsekv.evaluation.report import write_report
from sparsekv.kv_cache.quant import KV_CACHE_DTYPES
from sparsekv.sampling_params import SamplingParams

DEFAULT_CELLS = "auto,int8,fp8,int4,int8+snapkv@0.75"
# (num_prompts, input_len, output_len, num_texts, text_len)
SHAPES = {"full": (20, 4000, 256, 8, 3000), "quick": (6, 1500, 64, 3, 1000)}
COLUMNS = (
    "cell",
    "bytes_per_token",
    "tokens_per_gib",
    "prompt_tokens_per_gib",
    "output_tok_s",
    "ttft_p50_s",
    "peak_running",
    "num_preemptions",
    "agreement",
    "kl",
    "agreement_min",
)
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Cell:
    """One column of the comparison: a page format and a compression policy."""

    label: str
    kv_cache_dtype: str
    policy: CompressionConfig


def parse_cells(text: str, base: CompressionConfig) -> list[Cell]:
    """``"auto,int8+snapkv@0.75"`` -> cells; a method without ``@`` uses ``base``'s size.

    Raises:
        ValueError: an unknown format or method, or a ratio outside [0, 1).
    """
    cells = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        fmt, _, policy_text = item.partition("+")
        if fmt not in KV_CACHE_DTYPES:
            raise ValueError(f"cells: unknown format {fmt!r} (one of {KV_CACHE_DTYPES})")
        policy = CompressionConfig(method="none")
        if policy_text:
            method, _, ratio = policy_text.partition("@")
            if ratio:
                policy = dataclasses.replace(
                    base, method=method, budget=None, compression_ratio=float(ratio)
                )
            else:
                policy = dataclasses.replace(base, method=method)
            policy.validate()
        cells.append(Cell(item, fmt, policy))
    if not cells:
        raise ValueError("cells: nothing to run")
    return cells


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench kv-quant", __doc__)
    parser.add_argument("--cells", default=DEFAULT_CELLS, help=f"default {DEFAULT_CELLS}")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 20 (quick 6)")
    parser.add_argument("--input-len", type=int, default=None, help="default 4000 (quick 1500)")
    parser.add_argument("--output-len", type=int, default=None, help="default 256 (quick 64)")
    parser.add_argument("--num-texts", type=int, default=None, help="default 8 (quick 3)")
    parser.add_argument("--text-len", type=int, default=None, help="default 3000 (quick 1000)")
    parser.add_argument("--quick", action="store_true", help="a small run for a first look")
    parser.add_argument("--skip-speed", action="store_true", help="memory and fidelity only")
    parser.add_argument("--skip-fidelity", action="store_true", help="memory and speed only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    common.add_common_args(parser, "reports/kv_quant.json")
    add_engine_args(parser)
    parser.set_defaults(cache__kv_cache_memory=1.0, compression__method="none")
    return parser


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run every cell, print the table and write JSON + Markdown + PNG."""
    args = build_parser().parse_args(argv)
    document = run_kv_quant(args, checkpoint=checkpoint)
    print(common.format_table(document["rows"], COLUMNS))
    print(f"wrote {args.output} (+ .md, .png)")
    return 0


def run_kv_quant(args: argparse.Namespace, checkpoint=None) -> dict:
    """Memory, speed and fidelity of every cell; writes the report.

    Returns:
        ``{"rows", "provenance"}``.

    Raises:
        ValueError: invalid cells, or no long text of ``--text-len`` tokens on this machine.
    """
    common.apply_threads(args.threads)
    load_start = common.load_average()
    shape = SHAPES["quick" if args.quick else "full"]
    num_prompts, input_len, output_len = (
        args.num_prompts or shape[0],
        args.input_len or shape[1],
        args.output_len or shape[2],
    )
    num_texts, text_len = args.num_texts or shape[3], args.text_len or shape[4]
    config = engine_config_from_args(args)
    cells = parse_cells(args.cells, config.compression)
    checkpoint = common.load_checkpoint(config, checkpoint)
    vocab_size = checkpoint.hf_config.vocab_size
    avoid = common.special_token_ids(checkpoint.tokenizer)
    prompts = common.random_prompts(num_prompts, input_len, vocab_size, args.seed, avoid)
    texts = {}
    if not args.skip_fidelity:
        found = long_texts(checkpoint.tokenizer, min_tokens=text_len, count=num_texts)
        if not found:
            raise ValueError(f"text_len: no text of {text_len} tokens found on this machine")
        texts = {
            name: checkpoint.tokenizer.encode(text, add_special_tokens=False)[:text_len]
            for name, text in found
        }
    references = {}
    if texts:
        engine = common.build_engine(_with_format(config, "auto"), checkpoint)
        bar = _bar(texts, output_len=64, desc="reference", disable=args.no_progress)
        references = full_runs(engine, texts, 64, bar)
        bar.close()
        del engine
    rows = []
    for cell in cells:
        print(f"running {cell.label}", flush=True)
        rows.append(
            run_cell(args, config, checkpoint, cell, prompts, output_len, texts, references)
        )
        common.write_json(args.output, {"rows": rows, "partial": True})  # survives a crash
        gc.collect()
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    settings |= {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len}
    settings |= {"num_texts": len(texts), "text_len": text_len}
    prov = common.bench_provenance(config, settings, load_start)
    path = Path(args.output)
    write_report(
        path.parent,
        path.stem,
        rows,
        title=f"KV formats: {num_prompts} x {input_len} / {output_len}, fidelity on {len(texts)}",
        x="cell",
        y="output_tok_s" if not args.skip_speed else "agreement",
        provenance=prov,
    )
    return {"rows": rows, "provenance": prov}


def run_cell(
    args, config: EngineConfig, checkpoint, cell: Cell, prompts, output_len, texts, references
) -> dict:
    """One row: memory facts, then the speed run and the teacher-forced fidelity runs."""
    engine = common.build_engine(_with_format(config, cell.kv_cache_dtype), checkpoint)
    row: dict = {"cell": cell.label, "kv_cache_dtype": cell.kv_cache_dtype}
    row |= memory_facts(engine)
    if not args.skip_speed:
        common.warm_up(engine, checkpoint.hf_config.vocab_size)
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        speed = run_policy(engine, cell.label, cell.policy, prompts, params, not args.no_progress)
        keep = ("output_tok_s", "ttft_p50_s", "peak_running", "num_preemptions", "wall_s")
        row |= {key: speed[key] for key in keep}
        row["compression_ratio"] = speed["compression_ratio"]
    if texts:
        bar = _bar(texts, output_len=64, desc=cell.label, disable=args.no_progress)
        cells = [(cell.label, cell.policy.compression_ratio or 0.0, cell.policy)]
        results = compressed_runs(engine, texts, cells, references, bar)
        bar.close()
        row["agreement"] = statistics.fmean(r["agreement"] for r in results)
        row["kl"] = statistics.fmean(r["kl"] for r in results)
        row["agreement_min"] = min(r["agreement"] for r in results)
        row.setdefault(
            "compression_ratio", statistics.fmean(r["compression_ratio"] for r in results)
        )
    ratio = row.get("compression_ratio", 0.0) if cell.policy.enabled else 0.0
    row["prompt_tokens_per_gib"] = row["tokens_per_gib"] / (1.0 - ratio)
    return row


def memory_facts(engine) -> dict:
    """Stored bytes per token (all layers, codes and scales) and tokens per GiB of pool."""
    kv = engine.kv
    per_token = sum(kv.storage(layer).page_bytes for layer in range(kv.num_layers))
    per_token /= kv.block_size
    return {
        "bytes_per_token": per_token,
        "tokens_per_gib": GIB / per_token,
        "pages_total": kv.num_total_pages,
    }


def _with_format(config: EngineConfig, kv_cache_dtype: str) -> EngineConfig:
    cache = dataclasses.replace(config.cache, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype == "auto":
        cache = dataclasses.replace(cache, kv_cache_full_precision_layers=None)
    return dataclasses.replace(config, cache=cache)


def _bar(texts: dict, output_len: int, desc: str, disable: bool):
    total = sum(len(ids) + output_len for ids in texts.values())
    return tqdm(total=total, unit="tok", unit_scale=True, desc=desc, disable=disable)
