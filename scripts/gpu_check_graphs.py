"""Engine-level check on a GPU: CUDA-graph decode against eager decode.

Two engines over the same random-weight Llama-shaped model (a small SmolLM2-like shape: no
weights to carry) run the same greedy requests, one with ``enforce_eager`` (every step
eager), one with decode-only steps replayed from captured CUDA graphs (one per batch bucket).
Per case (dtype x full cache / SnapKV) it records whether the greedy tokens agree, the largest
logit difference over the positions before the first disagreement, whether the SnapKV kept
slots agree, how many graphs were captured and the decode throughput of both engines. Each
case is appended to the JSON file as soon as it exists.

Pass criteria: fp32 tokens and kept slots identical, logits within 1e-3 (a padded bucket
may pick another GEMM kernel than the eager batch); bf16 logits within 0.1 before any
disagreement (reported, ties flip greedy tokens in bf16).

    PYTHONPATH=. python scripts/gpu_check_graphs.py --out graphs.json      # on the GPU
    PYTHONPATH=. python scripts/gpu_check_graphs.py --device cpu --quick   # dry run: the
        static path without capture, as CPU CI checks it

Needs PyTorch, Triton and transformers (the tokenizer is built in memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsekv.compression.snapkv import SnapKVCompressor  # noqa: E402
from sparsekv.config import (  # noqa: E402
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from sparsekv.engine.engine_setup import build_engine_parts  # noqa: E402
from sparsekv.engine.llm_engine import LLMEngine  # noqa: E402
from sparsekv.sampling_params import SamplingParams  # noqa: E402
from tests.model.family_models import checkpoint_of, random_hf_model  # noqa: E402

VOCAB = 512


def model_config(quick: bool) -> transformers.LlamaConfig:
    """A SmolLM2-like shape (GQA 3:1, head_dim 64), fewer layers and a 512-token vocabulary."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=192 if quick else 576,
        intermediate_size=512 if quick else 1536,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=3 if quick else 9,
        num_key_value_heads=1 if quick else 3,
        max_position_embeddings=2048,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    return config


def make_engine(checkpoint, device: str, dtype: str, eager: bool, policy, max_num_seqs: int):
    config = EngineConfig(
        model=ModelConfig(dtype=dtype, device=device, enforce_eager=eager, max_model_len=1024),
        cache=CacheConfig(kv_cache_memory=0.25, block_size=16, enable_prefix_caching=False),
        compression=policy,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096),
    )
    engine = LLMEngine(config, build_engine_parts(config, checkpoint))
    if device == "cpu" and not eager:
        engine.parts.runner.use_static_decode(max_num_seqs, 1024, capture=False)
    return engine


def generate(engine, prompts, max_tokens: int):
    """Greedy tokens and logits per request, kept-slot selections, decode seconds."""
    kept = []
    select = SnapKVCompressor.select

    def recording(self, view, budget, window, scores=None):
        chosen = select(self, view, budget, window, scores)
        kept.append(chosen.cpu())
        return chosen

    SnapKVCompressor.select = recording
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params, collect_logits=True)
            requests[f"r{i}"] = engine._groups[f"r{i}"].samples[0].request
        engine.step()  # the prefills
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start, outputs = time.perf_counter(), {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        seconds = time.perf_counter() - start
    finally:
        SnapKVCompressor.select = select
    logits = {rid: torch.stack(request.logits) for rid, request in requests.items()}
    return outputs, logits, kept, seconds


def compare(checkpoint, device, dtype, policy, quick: bool) -> dict:
    num, max_tokens = (3, 12) if quick else (12, 64)
    generator = torch.Generator().manual_seed(0)
    lengths = [40 + 37 * i for i in range(num)]
    prompts = [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    results = {}
    for eager in (True, False):
        engine = make_engine(checkpoint, device, dtype, eager, policy, max_num_seqs=16)
        results[eager] = generate(engine, prompts, max_tokens)
        static = engine.parts.runner.static_decode
        if not eager:
            graphs = sorted(static.graphs) if static is not None else []
    (want, want_logits, want_kept, eager_s), (got, got_logits, got_kept, graph_s) = (
        results[True],
        results[False],
    )
    max_diff, same_tokens = 0.0, True
    for rid, tokens in want.items():
        agree = next((i for i, (a, b) in enumerate(zip(tokens, got[rid])) if a != b), None)
        same_tokens &= agree is None
        upto = len(tokens) if agree is None else agree + 1
        diff = (got_logits[rid][:upto] - want_logits[rid][:upto]).abs().max().item()
        max_diff = max(max_diff, diff)
    same_kept = len(got_kept) == len(want_kept) and all(
        torch.equal(a, b) for a, b in zip(got_kept, want_kept)
    )
    decode_tokens = sum(len(t) - 1 for t in want.values())
    tolerance = 1e-3 if dtype == "float32" else 0.1
    passed = max_diff <= tolerance and (dtype != "float32" or (same_tokens and same_kept))
    return {
        "device": device,
        "dtype": dtype,
        "policy": policy.method,
        "requests": num,
        "same_tokens": same_tokens,
        "same_kept": same_kept,
        "kept_selections": len(want_kept),
        "max_logit_diff": max_diff,
        "graphs_captured": graphs,
        "eager_decode_tok_s": decode_tokens / eager_s,
        "graph_decode_tok_s": decode_tokens / graph_s,
        "pass": passed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("graphs.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 3 requests")
    args = parser.parse_args()
    checkpoint = checkpoint_of(random_hf_model(model_config(args.quick), seed=0))
    snapkv = CompressionConfig(method="snapkv", budget=64, window=8, full_layers=0)
    cases = []
    ok = True
    for dtype in ("float32", "bfloat16"):
        if args.device == "cpu" and dtype == "bfloat16":
            continue  # the CPU dry run checks the path, not the bf16 arithmetic
        for policy in (CompressionConfig(method="none"), snapkv):
            case = compare(checkpoint, args.device, dtype, policy, args.quick)
            cases.append(case)
            ok &= case["pass"]
            args.out.write_text(json.dumps(cases, indent=1))
            print(json.dumps(case), flush=True)
    print(f"graph vs eager: {'PASS' if ok else 'FAIL'} ({len(cases)} cases)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
