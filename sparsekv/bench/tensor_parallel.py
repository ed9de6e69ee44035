"""Tensor parallelism against one process: output tok/s and the collectives' share of a step.

``python -m sparsekv.bench.tensor_parallel --tensor-parallel-size 2 --threads-per-rank 1``
prefills ``--batch`` random 128-token prompts, then decodes 65 tokens each (greedy, full cache)
and prints one JSON line: the decode's output tok/s, its mean step time and rank 0's time inside
``all_reduce`` / ``all_gather`` per step (waiting for the slower rank included: that is what a
collective costs the step). Run it once per setting; the figures of docs/scale-out.md came from
it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, ModelConfig
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.parallel_config import ParallelConfig
from sparsekv.sampling_params import SamplingParams

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 65


def time_collectives() -> dict[str, float]:
    """Wrap ``torch.distributed.all_reduce`` / ``all_gather`` of this process with timers;
    returns the counter they add to (``seconds``, ``calls``)."""
    spent = {"seconds": 0.0, "calls": 0}
    for name in ("all_reduce", "all_gather"):
        real = getattr(dist, name)

        def timed(*args, _real=real, **kwargs):
            start = time.perf_counter()
            result = _real(*args, **kwargs)
            spent["seconds"] += time.perf_counter() - start
            spent["calls"] += 1
            return result

        setattr(dist, name, timed)
    return spent


def run(engine: LLMEngine, batch: int, max_tokens: int, tag: str) -> tuple[float, int]:
    """``batch`` random prompts to completion: (seconds, engine steps)."""
    generator = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=generator).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{tag}{i}", prompt, params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    tp = args.tensor_parallel_size
    torch.set_num_threads(args.threads_per_rank)
    spent = time_collectives()
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype="float32"),
        cache=CacheConfig(kv_cache_memory=0.5),
        compression=CompressionConfig(method="none"),
        parallel=ParallelConfig(
            tensor_parallel_size=tp, threads_per_rank=args.threads_per_rank if tp > 1 else None
        ),
    )
    engine = LLMEngine(config)
    try:
        run(engine, args.batch, 4, "warm")
        prefill_s, _ = run(engine, args.batch, 1, "prefill")
        spent.update(seconds=0.0, calls=0)
        decode_s, steps = run(engine, args.batch, OUTPUT_TOKENS, "decode")
    finally:
        engine.shutdown()
    row = {
        "tensor_parallel_size": tp,
        "threads_per_rank": args.threads_per_rank,
        "batch": args.batch,
        "prefill_s": round(prefill_s, 3),
        "output_tok_s": round(args.batch * OUTPUT_TOKENS / decode_s, 2),
        "step_ms": round(1000 * decode_s / steps, 2),
        "collective_ms_per_step": round(1000 * spent["seconds"] / steps, 2),
        "collectives_per_step": round(spent["calls"] / steps, 1),
    }
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
