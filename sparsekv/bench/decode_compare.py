"""``sparsekv bench decode-compare``: batch-1 decode against llama.cpp on the same GGUF file.

Both engines generate ``--output-len`` tokens after a ``--context``-token prompt, one request,
``--threads`` threads: llama.cpp through ``llama-bench -p 0 -n N -d D`` (built from the
``llama-cpp-python`` sdist's vendored sources by ``scripts/build_llama_bench.sh``), sparsekv
through the offline engine once per ``--weight-dtypes`` entry (``gguf``: the file's Q4_1 blocks
kept packed; ``auto``: dequantized at load to the model dtype). The engines take turns: each of
``--repeats`` rounds runs llama-bench once (``-r 1``) and then every sparsekv engine once (all
loaded at the start), so a shared machine's load drifting over the run reaches every side
alike; the median over the rounds is reported with the spread (max - min), and each sparsekv
row's ``vs_llama_cpp`` is the median of its per-round ratios to llama.cpp.

Decode is bound by memory reads: each step streams every weight matrix once and the cache of
the tokens so far. The machine's read bandwidth is probed in the same run (a 512 MiB fp32 sum,
as ``bench roofline``); bytes per token = weights read by the matmuls (packed ones as stored;
the embedding only as a tied head) + K and V of the mean context over the timed tokens, in each
engine's cache format. ``fraction`` = (tokens/s x bytes per token) / read bandwidth, so 1.0
would be at the bound. Reports: JSON + Markdown (``--output``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

from torch import nn

from sparsekv.bench import common
from sparsekv.bench.llama_bench import gguf_shape, run_llama_bench
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser

COLUMNS = (
    "engine",
    "weights",
    "decode_tok_s",
    "decode_tok_s_spread",
    "weight_mb",
    "kv_mb",
    "bytes_per_token_mb",
    "achieved_gb_s",
    "bound_tok_s",
    "fraction",
    "vs_llama_cpp",
)
# Bytes per K/V element of sparsekv's page formats other than ``auto`` (scales excluded).
KV_FORMAT_BYTES = {"int8": 1.0, "fp8": 1.0, "int4": 0.5}


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench decode-compare", __doc__)
    parser.add_argument("--llama-bench", default=None, help="llama-bench binary (none: skip)")
    parser.add_argument("--context", type=int, default=512, help="tokens before decode (-d)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated (-n)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds, each engine once per round (median)"
    )
    parser.add_argument(
        "--weight-dtypes", nargs="+", default=["gguf", "auto"], help="sparsekv sides to run"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    parser.add_argument(
        "--probe-mib", type=int, default=512, help="size of the bandwidth probe's array (MiB)"
    )
    common.add_common_args(parser, "reports/compare_decode.json")
    add_engine_args(parser)
    parser.set_defaults(threads=2)
    return parser


def read_bandwidth(repeats: int, mib: int = 512) -> float:
    """Bytes/s of the best of ``repeats`` sums of an fp32 array of ``mib`` MiB (after one
    warm-up); the array must be far larger than the last-level cache."""
    import torch

    data = torch.ones(mib * 1024 * 1024 // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weight one decode step reads: every linear layer's weight as stored.

    Packed layers (``QuantizedLinear``: GGUF blocks, int8, bf16 rows; ``PackedLinear``) count
    their packed bytes; a tied head counts the embedding's matrix once; norms (a few KB) and the
    gathered embedding row are left out.
    """
    from sparsekv.models.prepack import PackedLinear
    from sparsekv.models.quant.linear import QuantizedLinear

    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_bytes
        elif isinstance(module, PackedLinear):
            total += module.packed_bytes
        elif isinstance(module, nn.Linear):
            key = module.weight.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += module.weight.numel() * module.weight.element_size()
    return total


def kv_bytes_per_slot(engine) -> float:
    """Bytes of K and V for one token in every layer, in the engine's page format."""
    model = engine.parts.model
    fmt = engine.config.cache.kv_cache_dtype
    element = engine.parts.dtype.itemsize if fmt == "auto" else KV_FORMAT_BYTES[fmt]
    return 2 * len(model.layer_specs()) * model.num_kv_heads * model.head_dim * element


class SparsekvSide:
    """One sparsekv engine (``weight_dtype``) kept loaded over the rounds: each round decodes
    the same random prompt once."""

    def __init__(self, args: argparse.Namespace, weight_dtype: str) -> None:
        local = copy.copy(args)
        local.model__weight_dtype = weight_dtype
        config = engine_config_from_args(local)
        checkpoint = common.load_checkpoint(config)
        self.engine = common.build_engine(config, checkpoint)
        vocab = checkpoint.hf_config.vocab_size
        common.warm_up(self.engine, vocab)
        avoid = common.special_token_ids(checkpoint.tokenizer)
        self.prompt = common.random_prompts(1, args.context, vocab, args.seed, avoid)[0]
        self.weight_dtype, self.args = weight_dtype, args
        self.samples: list[float] = []

    def run_round(self) -> None:
        """Decode once and keep its tokens/s."""
        from sparsekv.bench.throughput import run_single

        self.samples.append(
            run_single(self.engine, self.prompt, self.args.output_len)["decode_tok_s"]
        )

    def row(self) -> dict:
        """The report row (medians over the rounds); releases the engine."""
        engine = self.engine
        dtype = str(engine.parts.dtype).removeprefix("torch.")
        result = {
            "engine": "sparsekv",
            "weights": f"--weight-dtype {self.weight_dtype} ({dtype})",
            **_speeds(self.samples),
            "weight_bytes": decode_weight_bytes(engine.parts.model),
            "kv_bytes": kv_bytes_per_slot(engine) * mean_context(self.args),
        }
        self.engine = None
        gc.collect()
        return result


class LlamaCppSide:
    """llama-bench on the GGUF file, one repetition per round."""

    def __init__(self, args: argparse.Namespace, gguf_path: str) -> None:
        self.args, self.gguf_path = args, gguf_path
        self.samples: list[float] = []
        self.records: list[dict] = []

    def run_round(self) -> None:
        """Run ``llama-bench -r 1`` and keep its tokens/s (the median, should a build report
        several samples)."""
        args = self.args
        record = run_llama_bench(
            args.llama_bench, self.gguf_path, args.threads, args.context, args.output_len, 1
        )
        self.records.append(record)
        samples = [float(x) for x in record.get("samples_ts") or [record["avg_ts"]]]
        self.samples.append(statistics.median(samples))

    def row(self) -> dict:
        """The report row (medians over the rounds) with the first round's record."""
        record = self.records[0]
        shape = gguf_shape(self.gguf_path)
        return {
            "engine": "llama.cpp",
            "weights": f"{record.get('model_type', 'gguf')} (kv {record.get('type_k', 'f16')})",
            **_speeds(self.samples),
            "weight_bytes": shape.weight_bytes,
            "kv_bytes": shape.kv_bytes(mean_context(self.args), record.get("type_k", "f16")),
            "llama_bench": record,
        }


def mean_context(args: argparse.Namespace) -> float:
    """Tokens in the cache averaged over the timed steps: the prompt plus half the outputs."""
    return args.context + (args.output_len - 1) / 2


def _speeds(samples: list[float]) -> dict:
    return {
        "decode_tok_s": statistics.median(samples),
        "decode_tok_s_spread": max(samples) - min(samples),
        "samples_tok_s": samples,
    }


def with_bound(row: dict, bandwidth: float) -> dict:
    """Add bytes per token, achieved bandwidth and the fraction of the read-bandwidth bound."""
    per_token = row["weight_bytes"] + row["kv_bytes"]
    achieved = row["decode_tok_s"] * per_token
    return row | {
        "weight_mb": row["weight_bytes"] / 1e6,
        "kv_mb": row["kv_bytes"] / 1e6,
        "bytes_per_token_mb": per_token / 1e6,
        "achieved_gb_s": achieved / 1e9,
        "bound_tok_s": bandwidth / per_token,
        "fraction": achieved / bandwidth,
    }


def run_compare(args: argparse.Namespace) -> dict:
    """Run every side, then write ``args.output`` (JSON) and a Markdown table beside it.

    Raises:
        ValueError: a non-positive ``--context``, ``--output-len`` (< 2) or ``--repeats``, or a
            llama.cpp side asked for a model that is not a GGUF file.
    """
    from sparsekv.loader.resolve import resolve_model

    if args.context < 1 or args.output_len < 2 or args.repeats < 1:
        raise ValueError("context and repeats must be >= 1 and output_len >= 2")
    common.apply_threads(args.threads)
    load_start = common.load_average()
    config = engine_config_from_args(args)
    gguf_path = str(resolve_model(config.model.model))
    if args.llama_bench and not gguf_path.endswith(".gguf"):
        raise ValueError(f"model: llama-bench needs a GGUF file, got {gguf_path}")
    bandwidth = read_bandwidth(5, args.probe_mib)
    sides: list[LlamaCppSide | SparsekvSide] = []
    if args.llama_bench:
        sides.append(LlamaCppSide(args, gguf_path))
    sides += [SparsekvSide(args, dtype) for dtype in args.weight_dtypes]
    for _ in range(args.repeats):
        for side in sides:
            side.run_round()
    rows = [side.row() for side in sides]
    if args.llama_bench:
        for row in rows[1:]:
            row["vs_llama_cpp"] = common.paired_ratio(
                row["samples_tok_s"], rows[0]["samples_tok_s"]
            )
    bandwidth = max(
        bandwidth, read_bandwidth(5, args.probe_mib)
    )  # probed before and after: the quieter one
    rows = [with_bound(row, bandwidth) for row in rows]
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    document = {
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "model_file": gguf_path,
        "rows": rows,
        "provenance": common.bench_provenance(config, settings, load_start),
    }
    common.write_json(args.output, document)
    facts = {"read_bandwidth_gb_s": round(bandwidth / 1e9, 2), **document["provenance"]}
    table = [{c: row.get(c) for c in COLUMNS} for row in rows]
    md_path = str(args.output).removesuffix(".json") + ".md"
    title = f"Batch-1 decode, {args.context}-token context, {args.output_len} tokens"
    common.write_markdown(md_path, title, table, facts)
    return document


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run the comparison, print the table and write the report."""
    del checkpoint  # every side loads the model file itself (llama.cpp cannot take a tensor)
    args = build_parser().parse_args(argv)
    document = run_compare(args)
    print(f"read bandwidth {document['read_bandwidth_gb_s']:.2f} GB/s")
    print(common.format_table(document["rows"], COLUMNS))
    print(f"wrote {args.output}")
    return 0
