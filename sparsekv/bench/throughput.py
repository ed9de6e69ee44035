"""``sparsekv bench throughput``: offline throughput of one batch of random-token requests.

N requests of exactly ``--input-len`` random tokens and ``--output-len`` generated tokens
(greedy, ``ignore_eos``, fixed seed) are submitted at once to the offline engine. Reported:
output and total tokens/s, requests/s, wall time, peak KV pages, and each request's TTFT. With
``--hf-baseline`` the same workload runs through Hugging Face ``generate`` in the same process
(dense weights, same dtype, SDPA, DynamicCache, left padding, one batch) for a speed ratio.
``--single-ttft N`` and ``--decode-batch1`` add the latency figures: TTFT of one N-token
prompt, and decode tokens/s of one request.
"""

from __future__ import annotations

import argparse
import gc
import time

from sparsekv.bench import common
from sparsekv.bench.arg_types import int_at_least
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.models.quant.apply import weight_bytes
from sparsekv.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench throughput", __doc__)
    parser.add_argument(
        "--input-len",
        type=int_at_least(1),
        default=2000,
        help="prompt tokens per request (default %(default)s)",
    )
    parser.add_argument(
        "--output-len",
        type=int_at_least(1),
        default=128,
        help="generated tokens each (default %(default)s)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int_at_least(0),
        default=16,
        help="requests in the batch (default %(default)s; 0: skip the batch)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random prompts (default %(default)s)"
    )
    parser.add_argument("--hf-baseline", action="store_true", help="also run Hugging Face generate")
    parser.add_argument(
        "--single-ttft",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="TTFT of one N-token prompt",
    )
    parser.add_argument(
        "--decode-batch1", action="store_true", help="decode tokens/s of one request"
    )
    parser.add_argument(
        "--decode-input-len",
        type=int_at_least(1),
        default=512,
        help="prompt tokens of the batch-1 decode (default %(default)s)",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    common.add_common_args(parser, "reports/throughput.json")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run the benchmark, print a table and write the report."""
    args = build_parser().parse_args(argv)
    document = run_throughput(args, checkpoint=checkpoint)
    if document["rows"]:  # none with --num-prompts 0 (only the single-request figures)
        print(common.format_table(document["rows"], SUMMARY_COLUMNS))
    for line in document["notes"]:
        print(line)
    print(f"wrote {args.output}")
    return 0


SUMMARY_COLUMNS = (
    "system",
    "num_requests",
    "output_tokens",
    "wall_s",
    "output_tok_s",
    "total_tok_s",
    "requests_s",
    "ttft_p50_s",
    "ttft_max_s",
    "peak_pages_used",
)


def run_throughput(args: argparse.Namespace, checkpoint=None) -> dict:
    """Run every part the flags ask for and write ``args.output`` (JSON) plus a Markdown table.

    Returns:
        The report: ``rows`` (one per system), ``batch`` details (per-request TTFTs),
        ``single_ttft``, ``decode_batch1``, ``hf_speed_ratio``, ``weight_bytes`` (the model's
        weights in memory, packed ones as stored), ``notes`` and ``provenance``.
    """
    common.apply_threads(args.threads)
    load_start = common.load_average()
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    engine = common.build_engine(config, checkpoint)
    vocab_size = checkpoint.hf_config.vocab_size
    avoid = common.special_token_ids(checkpoint.tokenizer)
    if not args.no_warmup:
        common.warm_up(engine, vocab_size)
    document: dict = {"rows": [], "notes": [], "weight_bytes": weight_bytes(engine.parts.model)}
    document["notes"].append(
        f"weights in memory ({config.model.weight_dtype}): {document['weight_bytes'] / 1e6:.1f} MB"
    )
    settings = {k: v for k, v in vars(args).items() if "__" not in k}

    def save() -> None:  # after every part, so a long run that dies keeps what it measured
        document["provenance"] = common.bench_provenance(config, settings, load_start)
        _write(args.output, document)

    prompts = common.random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed, avoid)
    if prompts:
        batch = run_batch(engine, prompts, args.output_len, show_progress=not args.no_progress)
        document["batch"] = batch
        document["rows"].append(_summary_row("sparsekv", batch))
        save()
    if args.single_ttft:
        prompt = common.random_prompts(1, args.single_ttft, vocab_size, args.seed + 1, avoid)[0]
        document["single_ttft"] = run_single(engine, prompt, 1)
        ttft = document["single_ttft"]["ttft_s"]
        document["notes"].append(f"single TTFT, {args.single_ttft} tokens: {ttft:.3f} s")
        save()
    if args.decode_batch1:
        length = args.decode_input_len
        prompt = common.random_prompts(1, length, vocab_size, args.seed + 2, avoid)[0]
        document["decode_batch1"] = run_single(engine, prompt, args.output_len)
        speed = document["decode_batch1"]["decode_tok_s"]
        document["notes"].append(
            f"decode at batch 1 ({args.decode_input_len}-token prompt): {speed:.2f} tok/s"
        )
        save()
    if args.hf_baseline and prompts:
        # The engine's page pool is freed first: both caches at once can exhaust host memory.
        del engine
        gc.collect()
        hf = hf_generate(checkpoint, common.resolved_dtype(config), prompts, args.output_len)
        document["hf"] = hf
        document["rows"].append(_summary_row("hf-transformers", hf))
        ratio = document["batch"]["output_tok_s"] / hf["output_tok_s"]
        document["hf_speed_ratio"] = ratio
        document["notes"].append(f"sparsekv / HF output tokens/s: {ratio:.2f}x")
    save()
    return document


def _write(output: str, document: dict) -> None:
    """The JSON report and a Markdown summary beside it."""
    common.write_json(output, document)
    facts = {"notes": document["notes"], **document["provenance"]}
    md_path = str(output).removesuffix(".json") + ".md"
    common.write_markdown(md_path, "Offline throughput", document["rows"] or [{}], facts)


def run_batch(
    engine, prompts: list[list[int]], output_len: int, show_progress: bool = False
) -> dict:
    """All ``prompts`` at once through ``engine``; throughput, TTFTs and pool peaks."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    requests = [common.BenchRequest(f"tp-{i}", p, params) for i, p in enumerate(prompts)]
    bar = common.progress_bar(requests, "batch", disable=not show_progress)
    outputs, trace = common.run_requests(engine, requests, progress=bar)
    bar.close()
    ordered = [outputs[r.request_id] for r in requests]
    num_output = sum(len(o.outputs[0].token_ids) for o in ordered)
    num_prompt = sum(len(p) for p in prompts)
    ttfts = [common.ttft_s(o) for o in ordered]
    ratios = [o.kv_stats.compression_ratio for o in ordered if o.kv_stats is not None]
    return {
        "num_requests": len(prompts),
        "input_len": len(prompts[0]),
        "output_len": output_len,
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "wall_s": trace.wall_s,
        "output_tok_s": num_output / trace.wall_s,
        "total_tok_s": (num_prompt + num_output) / trace.wall_s,
        "requests_s": len(prompts) / trace.wall_s,
        "ttft_s": ttfts,
        "ttft_p50_s": common.percentile(ttfts, 50),
        "ttft_max_s": max(ttfts),
        "peak_pages_used": trace.peak_pages_used,
        "pages_total": trace.pages_total,
        "peak_running": trace.peak_running,
        "num_preemptions": trace.num_preemptions,
        "num_steps": trace.num_steps,
        "compression_ratio_mean": sum(ratios) / len(ratios) if ratios else 0.0,
    }


def run_single(engine, prompt: list[int], output_len: int) -> dict:
    """One request alone: its TTFT and, past the first token, its decode tokens/s."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outputs, trace = common.run_requests(engine, [common.BenchRequest("single", prompt, params)])
    output = outputs["single"]
    num_output = len(output.outputs[0].token_ids)
    decode_s = output.metrics["last_token"] - output.metrics["first_token"]
    result = {
        "input_len": len(prompt),
        "output_tokens": num_output,
        "ttft_s": common.ttft_s(output),
        "wall_s": trace.wall_s,
    }
    if num_output > 1:
        result["decode_s"] = decode_s
        result["decode_tok_s"] = (num_output - 1) / decode_s
        result["tpot_s"] = decode_s / (num_output - 1)
    return result


def _summary_row(system: str, result: dict) -> dict:
    row = {"system": system}
    for key in SUMMARY_COLUMNS[1:]:
        if key in result:
            row[key] = result[key]
    return row


def hf_generate(checkpoint, dtype, prompts: list[list[int]], output_len: int) -> dict:
    """The same workload through Hugging Face ``generate``: the speed baseline.

    Dense weights from the same checkpoint in the same dtype, SDPA attention, the default
    DynamicCache, left padding, all prompts in one batch, greedy, and
    ``min_new_tokens = max_new_tokens`` so every row generates exactly ``output_len`` tokens.
    TTFT is the time until the first logits processor call (after the batched prefill).
    """
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_config(
        checkpoint.hf_config, attn_implementation="sdpa", dtype=dtype
    )
    model.load_state_dict(checkpoint.state_dict, strict=False)
    model.tie_weights()
    model.eval()
    pad_id = _pad_token_id(checkpoint)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    first_call = _FirstCall()
    start = time.perf_counter()
    with torch.inference_mode():
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([first_call]),
        )
    wall = time.perf_counter() - start
    num_output = int((generated.shape[1] - width) * len(prompts))
    num_prompt = sum(len(p) for p in prompts)
    ttft = (first_call.time or start) - start
    return {
        "num_requests": len(prompts),
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "wall_s": wall,
        "output_tok_s": num_output / wall,
        "total_tok_s": (num_prompt + num_output) / wall,
        "requests_s": len(prompts) / wall,
        "ttft_p50_s": ttft,
        "ttft_max_s": ttft,
    }


class _FirstCall:
    """A pass-through logits processor that records when generate first calls it."""

    def __init__(self) -> None:
        self.time: float | None = None

    def __call__(self, input_ids, scores):
        if self.time is None:
            self.time = time.perf_counter()
        return scores


def _pad_token_id(checkpoint) -> int:
    for source in (checkpoint.tokenizer, checkpoint.hf_config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int):
                return value
    return 0
