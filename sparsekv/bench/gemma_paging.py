"""``sparsekv bench gemma-paging``: Gemma 3 with sliding-window-aware paging vs all-full paging.

Gemma 3 has 5 local (sliding-window, 512 tokens in 270M) layers per global one. Paged as
``LayerSpec("sliding")`` a local layer frees every page wholly outside its window, so it holds
about ``window + block_size`` slots per request however long the request grows; paged as
``full`` (the baseline: the config's ``sliding_aware_paging = False``) it keeps every token,
while its attention still masks with the window, so both runs compute the same outputs.

N requests of exactly ``--input-len`` random tokens and ``--output-len`` greedy tokens
(``ignore_eos``, fixed seed) run in both modes, one after the other in one process, with the
same pool (``--num-pages``; by default just big enough for the all-full run, so neither mode
preempts) and no compression (``--kv-compression none`` unless given). Reported per mode: peak
KV pages in use (all layers, and split into local / global layers), wall time, output tokens/s
over the run and over the decode-only steps, TTFTs, and whether the greedy outputs are
identical. ``--passkey-length 8192`` adds passkey retrieval at 5 depths, full cache vs SnapKV
at 75% removed on the global layers. JSON and Markdown reports go to ``--output`` (default
``reports/gemma_paging.json``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

from sparsekv.bench import common
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.config import CompressionConfig
from sparsekv.evaluation.scoring import score_passkey
from sparsekv.evaluation.tasks import passkey
from sparsekv.models.gemma3 import SLIDING, text_config
from sparsekv.sampling_params import SamplingParams

MODES = {"sliding-aware": True, "all-full": False}
GIB = 1 << 30
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PASSKEY_ANSWER_PREFIX = "\nI remember it. The pass key is"
PASSKEY_POLICIES = {
    "full": CompressionConfig(method="none"),
    "snapkv-75%-removed": CompressionConfig(
        method="snapkv", compression_ratio=0.75, budget=None, full_layers=0
    ),
}

SUMMARY_COLUMNS = (
    "paging",
    "peak_pages_used",
    "peak_pages_local",
    "peak_pages_global",
    "peak_pages_between_steps",
    "peak_kv_gib",
    "wall_s",
    "cpu_s",
    "output_tok_s",
    "decode_tok_s",
    "ttft_p50_s",
    "num_preemptions",
)


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench gemma-paging", __doc__)
    parser.add_argument("--num-requests", type=int, default=8, help="requests in the batch")
    parser.add_argument("--input-len", type=int, default=8192, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens each")
    parser.add_argument(
        "--quick", action="store_true", help="2 requests x 1536 / 16 tokens (a smoke run)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    parser.add_argument(
        "--passkey-length",
        type=int,
        default=0,
        metavar="N",
        help="also run passkey retrieval at N tokens, 5 depths: full cache vs SnapKV at 75%% "
        "removed on the global layers (sliding-aware paging); 0 skips it",
    )
    common.add_common_args(parser, "reports/gemma_paging.json")
    add_engine_args(parser)
    parser.set_defaults(model__model="gemma3-270m", compression__method="none")
    return parser


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run both paging modes, print a table and write the report."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.num_requests, args.input_len, args.output_len = 2, 1536, 16
    document = run_gemma_paging(args, checkpoint=checkpoint)
    print(common.format_table(document["rows"], SUMMARY_COLUMNS))
    for line in document["notes"]:
        print(line)
    print(f"wrote {args.output}")
    return 0


def run_gemma_paging(args: argparse.Namespace, checkpoint=None) -> dict:
    """Run the workload in both paging modes and write ``args.output`` (+ Markdown).

    Returns:
        The report: ``rows`` (one per mode), ``runs`` (per-mode details), ``same_outputs``,
        ``notes`` and ``provenance``.

    Raises:
        ValueError: the model has no sliding-window layers (not a Gemma 3 checkpoint).
    """
    common.apply_threads(args.threads)
    load_start = common.load_average()
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    hf_config = text_config(checkpoint.hf_config)
    if SLIDING not in (getattr(hf_config, "layer_types", None) or ()):
        raise ValueError("model: gemma-paging needs a model with sliding-window layers (Gemma 3)")
    if config.cache.num_pages is None:
        config.cache.num_pages = all_full_pages(args, hf_config.num_hidden_layers)
    vocab_size = hf_config.vocab_size
    avoid = common.special_token_ids(checkpoint.tokenizer)
    prompts = common.random_prompts(args.num_requests, args.input_len, vocab_size, args.seed, avoid)
    runs = {}
    for mode, sliding_aware in MODES.items():
        engine = common.build_engine(config, _with_paging(checkpoint, sliding_aware))
        if not args.no_warmup:
            common.warm_up(engine, vocab_size)
        runs[mode] = run_batch(engine, prompts, args.output_len)
        del engine  # free this mode's pool before the next one allocates its own
    document = _document(runs)
    if args.passkey_length:
        document["passkey"] = run_passkey(config, checkpoint, args.passkey_length)
        for row in document["passkey"]:
            document["notes"].append(
                f"passkey {row['length']} tokens, {row['policy']}: found {row['found']}/5"
            )
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    document["provenance"] = common.bench_provenance(config, settings, load_start)
    common.write_json(args.output, document)
    facts = {"notes": document["notes"], **document["provenance"]}
    md_path = str(args.output).removesuffix(".json") + ".md"
    common.write_markdown(md_path, "Gemma 3 sliding-window paging", document["rows"], facts)
    return document


def run_passkey(config, checkpoint, length: int) -> list[dict]:
    """Passkey at ``length`` tokens and 5 depths, per policy in ``PASSKEY_POLICIES``.

    The prompt is a completion ending in ``PASSKEY_ANSWER_PREFIX``: Gemma 3 270M is a base
    model and repeats the instruction when given the chat template.
    """
    tokenizer = checkpoint.tokenizer
    samples = [passkey(tokenizer, length, d, seed=i) for i, d in enumerate(PASSKEY_DEPTHS)]
    prompts = [tokenizer(s.prompt_text + PASSKEY_ANSWER_PREFIX).input_ids for s in samples]
    num_layers = text_config(checkpoint.hf_config).num_hidden_layers
    per_request = num_layers * -(-(max(map(len, prompts)) + 8) // config.cache.block_size)
    cache = dataclasses.replace(config.cache, num_pages=(len(prompts) + 1) * per_request)
    engine = common.build_engine(dataclasses.replace(config, cache=cache), checkpoint)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    rows = []
    for name, policy in PASSKEY_POLICIES.items():
        requests = [
            common.BenchRequest(f"pk-{name}-{i}", ids, params, policy)
            for i, ids in enumerate(prompts)
        ]
        outputs, trace = common.run_requests(engine, requests)
        texts = [outputs[r.request_id].outputs[0].text for r in requests]
        found = [score_passkey(t, s.answers) == 100.0 for t, s in zip(texts, samples)]
        rows.append(
            {
                "policy": name,
                "length": len(prompts[0]),
                "found": sum(found),
                "found_per_depth": dict(zip(PASSKEY_DEPTHS, found)),
                "answers": texts,
                "kept_per_layer": outputs[requests[0].request_id].kv_stats.kept_per_layer,
                "peak_pages_used": trace.peak_pages_used,
                "wall_s": trace.wall_s,
            }
        )
    return rows


def all_full_pages(args: argparse.Namespace, num_layers: int) -> int:
    """A pool that holds the whole workload with every layer paged as full (no preemption in
    either mode, so both do the same work), plus one request's worth of slack for the warm-up.
    """
    block_size = args.cache__block_size
    per_layer = -(-(args.input_len + args.output_len) // block_size)
    return (args.num_requests + 1) * num_layers * per_layer


def _with_paging(checkpoint, sliding_aware: bool):
    """A shallow copy of ``checkpoint`` whose config sets ``sliding_aware_paging``."""
    hf_config = copy.deepcopy(checkpoint.hf_config)
    text_config(hf_config).sliding_aware_paging = sliding_aware
    result = copy.copy(checkpoint)
    result.hf_config = hf_config
    return result


def run_batch(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Submit every prompt at once and step to the end, sampling the pool in every step.

    Pages are sampled inside each step, after its allocation and before the window trim (the
    true peak), and again after it. A step counts as decode-only when, before
    it runs, nothing waits and every running request has its prompt computed.
    """
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"gp-{i}" for i in range(len(prompts))]
    local = [kind == SLIDING for kind in engine.parts.model.layer_types]
    page_bytes = engine.kv.page_bytes
    peak = {"all": 0, "local": 0, "global": 0}
    peak_between = 0
    decode_s = decode_tokens = 0.0
    execute = engine.runner.execute

    def execute_sampling_pages(scheduled):
        _update_peaks(engine, local, peak)
        return execute(scheduled)

    engine.runner.execute = execute_sampling_pages  # this engine only; dropped below
    start, start_cpu = time.perf_counter(), time.process_time()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished = {}
    try:
        while engine.has_unfinished_requests():
            decode_only = not engine.scheduler.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running
            )
            step_start = time.perf_counter()
            outputs = engine.step()
            step_s = time.perf_counter() - step_start
            peak_between = max(peak_between, int(engine.kv_usage()["pages_used"]))
            if decode_only:
                decode_s += step_s
                decode_tokens += sum(o.outputs[0].num_delta_tokens for o in outputs)
            for output in outputs:
                if output.error is not None:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                if output.finished:
                    finished[output.request_id] = output
    finally:
        del engine.runner.execute
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    ordered = [finished[i] for i in ids]
    ttfts = [common.ttft_s(o) for o in ordered]
    num_output = sum(len(o.outputs[0].token_ids) for o in ordered)
    return {
        "num_requests": len(prompts),
        "input_len": len(prompts[0]),
        "output_len": output_len,
        "output_tokens": num_output,
        "wall_s": wall,
        # Process CPU seconds: steadier than wall time when other jobs share the cores.
        "cpu_s": cpu,
        "output_tok_s": num_output / wall,
        "decode_tok_s": decode_tokens / decode_s if decode_s else None,
        "decode_steps_s": decode_s,
        "ttft_s": ttfts,
        "ttft_p50_s": common.percentile(ttfts, 50),
        "peak_pages_used": peak["all"],
        "peak_pages_local": peak["local"],
        "peak_pages_global": peak["global"],
        "peak_pages_between_steps": peak_between,
        "peak_kv_gib": peak["all"] * page_bytes / GIB,
        "pages_total": engine.kv.num_total_pages,
        "num_preemptions": engine.stats.num_preemptions,
        "token_ids": [o.outputs[0].token_ids for o in ordered],
    }


def _update_peaks(engine, local: list[bool], peak: dict[str, int]) -> None:
    """Fold the pages held now (pool-wide, and per layer kind) into ``peak``."""
    usage = engine.kv_usage()
    peak["all"] = max(peak["all"], int(usage["pages_used"]))
    pages_local = pages_global = 0
    for request in engine.scheduler.running:
        if not engine.kv.has(request.request_id):
            continue
        for is_local, layer in zip(local, engine.kv.get(request.request_id).layers):
            if is_local:
                pages_local += len(layer.block_table)
            else:
                pages_global += len(layer.block_table)
    peak["local"] = max(peak["local"], pages_local)
    peak["global"] = max(peak["global"], pages_global)


def _document(runs: dict[str, dict]) -> dict:
    aware, full = runs["sliding-aware"], runs["all-full"]
    same = aware["token_ids"] == full["token_ids"]
    rows = []
    for mode, run in runs.items():
        row = {"paging": mode}
        row.update({k: run[k] for k in SUMMARY_COLUMNS[1:] if k in run})
        rows.append(row)
    notes = [
        f"{aware['num_requests']} requests x {aware['input_len']} input / "
        f"{aware['output_len']} output tokens, greedy outputs identical: {same}",
        f"peak pages: all-full / sliding-aware = "
        f"{full['peak_pages_used'] / aware['peak_pages_used']:.2f}x",
        f"output tokens/s: sliding-aware / all-full = "
        f"{aware['output_tok_s'] / full['output_tok_s']:.2f}x",
    ]
    if aware["decode_tok_s"] and full["decode_tok_s"]:
        ratio = aware["decode_tok_s"] / full["decode_tok_s"]
        notes.append(f"decode-only tokens/s: sliding-aware / all-full = {ratio:.2f}x")
    return {"rows": rows, "runs": runs, "same_outputs": same, "notes": notes}
