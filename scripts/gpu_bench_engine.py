"""Engine throughput on a GPU with random-weight models: full cache against SnapKV.

Models are built from public configs with random weights (nothing to download or carry):
Llama-3-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads, MLP 14336, vocabulary
128256, RoPE theta 500000) and SmolLM2-135M's. The tokenizer is the small file
``scripts/bench_tokenizer.json`` beside this script (256 placeholder tokens: prompts are random
token ids, generated text is never read). Each run submits ``concurrency`` requests of
``--input-len`` random tokens at once (greedy, ``ignore_eos``, ``--output-len`` tokens each) to
one engine per model, the compression method chosen per request, and records output tokens/s
and the median time to first token. Llama-3-8B's shape sweeps concurrency 1, 8, 32, 64;
SmolLM2's runs at concurrency 1. Each result is appended to ``--out`` (JSON) as soon as it
exists; a run that fails records its error and the sweep goes on; runs that would start after
``--deadline-s`` are recorded as skipped.

    PYTHONPATH=. python scripts/gpu_bench_engine.py --out engine_bench.json
    PYTHONPATH=. python scripts/gpu_bench_engine.py --smoke --out /tmp/smoke.json   # CPU, tiny

Needs PyTorch, Triton (on CUDA) and transformers only.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TOKENIZER_FILE = HERE / "bench_tokenizer.json"
EOS_TOKEN = "<|eos|>"

# Public configs (Hugging Face model cards), the weights replaced by random ones.
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SMOKE_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


class RandomStateDict(Mapping):
    """Hugging Face parameter names of a config -> random tensors made on access.

    Nothing is held: the engine's loader copies each tensor into the model as it reads it, so
    an 8B model never exists twice on the device. Norm weights are ones, every other weight
    is normal with the config's ``initializer_range`` (0.02) as standard deviation.
    """

    def __init__(self, hf_config, dtype: torch.dtype, device: str, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            shapes = AutoModelForCausalLM.from_config(hf_config).state_dict()
        self.shapes = {name: tuple(t.shape) for name, t in shapes.items()}
        self.std = float(getattr(hf_config, "initializer_range", 0.02))
        self.dtype, self.device = dtype, device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        return tensor.normal_(0.0, self.std, generator=self.generator)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def write_tokenizer(path: Path) -> None:
    """The placeholder tokenizer file: a word-level vocabulary of ``EOS_TOKEN`` and 255 tokens
    ``<1>`` .. ``<255>``; ids past it decode to nothing."""
    from tokenizers import Tokenizer, models

    vocab = {EOS_TOKEN: 0, **{f"<{i}>": i for i in range(1, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TOKEN))
    tokenizer.add_special_tokens([EOS_TOKEN])
    tokenizer.save(str(path))


def load_tokenizer(path: Path = TOKENIZER_FILE):
    """The carried tokenizer as a transformers fast tokenizer (no download)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS_TOKEN)


def random_checkpoint(name: str, shape: dict, dtype: torch.dtype, device: str, tokenizer):
    """A checkpoint namespace (what ``build_engine_parts`` takes) of random weights."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**shape, eos_token_id=0, bos_token_id=0)
    return types.SimpleNamespace(
        name=name,
        path=None,
        hf_config=hf_config,
        tokenizer=tokenizer,
        state_dict=RandomStateDict(hf_config, dtype, device),
    )


def engine_config(args: argparse.Namespace, max_seqs: int, context: int):
    """SnapKV engine settings (budget ``--budget``; full-cache requests opt out per request);
    ``max_model_len`` fits the longest request, at most the model's ``context`` (the engine
    refuses a longer one)."""
    from sparsekv.config import (
        CacheConfig,
        CompressionConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    cache = CacheConfig(enable_prefix_caching=False)
    if args.kv_cache_memory is not None:
        cache = CacheConfig(enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory)
    return EngineConfig(
        model=ModelConfig(
            dtype=args.dtype,
            device=args.device,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            max_model_len=min(args.input_len + args.output_len + 64, context),
        ),
        cache=cache,
        compression=CompressionConfig(
            method="snapkv", budget=args.budget, window=args.window, full_layers=args.full_layers
        ),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs),
    )


def run_wave(engine, prompts: list[list[int]], method: str, output_len: int) -> dict:
    """All ``prompts`` at once with compression ``method`` ("none" or "snapkv"), stepped to
    the end: output tokens/s over the wave's wall time, TTFT median and maximum, pool peak."""
    from sparsekv.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"{method}-{len(prompts)}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params, {"method": method})
    finished, peak_pages, steps = {}, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            if output.finished:
                finished[output.request_id] = output
        peak_pages = max(peak_pages, int(engine.kv_usage()["pages_used"]))
        steps += 1
    wall_s = time.perf_counter() - start
    outputs = [finished[request_id] for request_id in ids]
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = sorted(o.metrics["first_token"] - o.metrics["arrival"] for o in outputs)
    ratios = [o.kv_stats.compression_ratio for o in outputs if o.kv_stats is not None]
    return {
        "output_tokens": num_output,
        "wall_s": wall_s,
        "output_tok_s": num_output / wall_s,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": ttfts[-1],
        "num_steps": steps,
        "peak_pages_used": peak_pages,
        "pages_total": engine.kv.num_total_pages,
        "compression_ratio_mean": sum(ratios) / len(ratios) if ratios else 0.0,
    }


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` uniform random ids in ``[1, vocab_size)`` (0 is EOS)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (count, length), generator=gen).tolist()


def plan(args: argparse.Namespace) -> list[tuple[str, dict, list[int]]]:
    """(model name, shape, concurrencies) in run order: the Llama-3-8B sweep first (by
    default its concurrency 32 and 64 early, the figures the check is for), then SmolLM2."""
    if args.smoke:
        return [("smoke-llama", SMOKE_MODEL, [1, 2])]
    models = {
        "llama": ("llama-3-8b-random", LLAMA3_8B, args.concurrency),
        "smollm2": ("smollm2-135m-random", SMOLLM2_135M, args.smollm2_concurrency),
    }
    return [models[name] for name in args.models]


def int_list(text: str) -> list[int]:
    """``"1,32,64"`` -> ``[1, 32, 64]`` (argparse type)."""
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("engine_bench.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths (CPU test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--budget", type=int, default=1024, help="SnapKV slots per layer")
    parser.add_argument("--window", type=int, default=32, help="SnapKV observation window")
    parser.add_argument("--full-layers", type=int, default=2, help="leading layers kept whole")
    parser.add_argument(
        "--kv-cache-memory", type=float, default=None, help="GiB (default: from the device)"
    )
    parser.add_argument("--deadline-s", type=float, default=240.0, help="start no run after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--models", type=lambda t: t.split(","), default=["llama", "smollm2"],
        help="comma-separated, in run order: llama (Llama-3-8B shape), smollm2",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int_list, default=[1, 32, 64, 8], help="Llama-3-8B sweep"
    )
    parser.add_argument("--smollm2-concurrency", type=int_list, default=[1])
    parser.add_argument("--write-tokenizer", type=Path, help="write the tokenizer file and exit")
    args = parser.parse_args(argv)
    if not set(args.models) <= {"llama", "smollm2"}:
        parser.error(f"--models: choose from llama, smollm2, got {args.models}")
    if args.write_tokenizer is not None:
        write_tokenizer(args.write_tokenizer)
        return 0
    if args.smoke:
        args.device, args.dtype, args.input_len, args.output_len = "cpu", "float32", 40, 4
        args.budget, args.window, args.full_layers = 24, 4, 0
        args.kv_cache_memory = args.kv_cache_memory or 0.05

    from sparsekv.engine.engine_setup import build_engine_parts, resolve_dtype
    from sparsekv.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    document: dict = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        },
        "runs": [],
    }

    def record(entry: dict) -> None:
        document["runs"].append(entry)
        document["elapsed_s"] = time.perf_counter() - start
        args.out.write_text(json.dumps(document, indent=1))
        print(json.dumps(entry), flush=True)

    tokenizer = load_tokenizer()
    dtype = resolve_dtype(args.dtype, args.device)
    for name, shape, concurrencies in plan(args):
        if time.perf_counter() - start > args.deadline_s:
            record({"model": name, "skipped": "deadline"})
            continue
        engine = None
        try:
            built = time.perf_counter()
            checkpoint = random_checkpoint(name, shape, dtype, args.device, tokenizer)
            config = engine_config(args, max(concurrencies), shape["max_position_embeddings"])
            engine = LLMEngine(config, build_engine_parts(config, checkpoint))
            del checkpoint
            # Kernels compile outside the timings: a prompt past the budget compresses.
            warm_len = min(args.input_len, args.budget + 4 * args.window)
            run_wave(engine, random_prompts(2, warm_len, shape["vocab_size"], 1), "snapkv", 4)
            run_wave(engine, random_prompts(1, warm_len, shape["vocab_size"], 2), "none", 4)
            record({"model": name, "build_s": time.perf_counter() - built})
        except Exception:  # one model failing must not stop the other
            record({"model": name, "error": traceback.format_exc(limit=8)})
            continue
        for concurrency in concurrencies:
            for method in ("none", "snapkv"):
                entry = {"model": name, "method": method, "concurrency": concurrency}
                if time.perf_counter() - start > args.deadline_s:
                    record(entry | {"skipped": "deadline"})
                    continue
                try:
                    prompts = random_prompts(
                        concurrency, args.input_len, shape["vocab_size"], args.seed
                    )
                    entry |= run_wave(engine, prompts, method, args.output_len)
                except Exception:
                    entry["error"] = traceback.format_exc(limit=8)
                record(entry)
            full, sparse = document["runs"][-2:]
            if "output_tok_s" in full and "output_tok_s" in sparse:
                ratio = sparse["output_tok_s"] / full["output_tok_s"]
                document.setdefault("snapkv_over_full", {})[f"{name}@{concurrency}"] = ratio
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    document["elapsed_s"] = time.perf_counter() - start
    args.out.write_text(json.dumps(document, indent=1))
    failed = [r for r in document["runs"] if "error" in r]
    print(f"{len(document['runs'])} entries, {len(failed)} failed, {document['elapsed_s']:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
