"""Decode steps of a batch: N prompts of L tokens prefilled, then 10 decode steps timed and a
few more profiled (torch.profiler, by self CPU time). Takes the engine flags of `sparsekv
generate`; run under the AVX2 variables of summary.md, e.g. `python decode_step_profile.py
--dtype float32`."""
import argparse, time
import torch
from sparsekv.bench import common
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.sampling_params import SamplingParams

p = argparse.ArgumentParser()
add_engine_args(p)
p.add_argument("--n", type=int, default=16)
p.add_argument("--len", type=int, default=2000)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--profile", type=int, default=8)
args = p.parse_args()
common.apply_threads(args.threads)
config = engine_config_from_args(args)
ckpt = common.load_checkpoint(config, None)
engine = common.build_engine(config, ckpt)
vocab = ckpt.hf_config.vocab_size
avoid = common.special_token_ids(ckpt.tokenizer)
common.warm_up(engine, vocab)
prompts = common.random_prompts(args.n, args.len, vocab, 7, avoid)
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
for i, pr in enumerate(prompts):
    engine.add_request(str(i), pr, params)
times = []
while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
    t = time.perf_counter(); engine.step(); times.append(time.perf_counter() - t)
print("prefill steps", len(times), f"{sum(times):.1f} s")
dt = []
for _ in range(10):
    t = time.perf_counter(); engine.step(); dt.append(time.perf_counter() - t)
print("decode steps ms", [round(x * 1e3) for x in dt])
with torch.profiler.profile() as prof:
    for _ in range(args.profile):
        engine.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
