"""``sparsekv bench roofline``: how close the engine's prefill and decode come to the machine.

The machine is probed once with the kernel bench's probe (``bench.kernels.measure_machine``:
read bandwidth of a 512 MiB fp32 sum, 1024^3 matmul FLOP/s per dtype). For each ``--batch`` at
``--context`` tokens, lower bounds are computed from the model's shapes:

* decode step >= max(bytes / bandwidth, FLOPs / peak), bytes = weights read by the matmuls
  (every layer and the LM head; the embedding only when it is the tied head) + the K/V slots the
  requests actually hold at that step (after compression, read from the engine);
* prefill >= FLOPs / peak, FLOPs = 2 x body parameters x prompt tokens + causal attention
  (2 x layers x heads x head_dim x n x (n + 1)) + the LM head on the last position.

Then a real workload runs through ``LLMEngine`` (random prompts, greedy, EOS ignored): prefill
wall time until every request has its first token, then ``--steps`` timed decode steps (one
untimed first). ``fraction`` = bound / measured (1.0 would be at the roofline). JSON report with
provenance (``--output``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from sparsekv.bench import common
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.models.prepack import PackedLinear
from sparsekv.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelShape:
    """What the bounds need from a model.

    Attributes:
        body_params: parameters of the decoder layers and final norm (matmul weights per token).
        head_params: LM head parameters (``vocab_size x hidden``).
        weight_bytes: bytes one decode step reads: body + head (the embedding is gathered).
        num_layers / num_heads / num_kv_heads / head_dim: attention shape.
        element_size: bytes per weight and per K/V element.
    """

    body_params: int
    head_params: int
    weight_bytes: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    element_size: int

    @classmethod
    def of(cls, model) -> ModelShape:
        """Shapes of an engine model (``LlamaForCausalLM`` or ``Gemma3ForCausalLM``)."""
        body = sum(
            p.numel()
            for name, p in model.named_parameters()
            if not name.startswith(("embed_tokens", "lm_head"))
        )
        # Pre-packed linears (sparsekv.models.prepack) hold their weights as buffers.
        body += sum(
            m.in_features * m.out_features
            for name, m in model.named_modules()
            if isinstance(m, PackedLinear) and not name.startswith("lm_head")
        )
        head = model.lm_head.in_features * model.lm_head.out_features
        element = model.embed_tokens.weight.element_size()
        return cls(
            body_params=body,
            head_params=head,
            weight_bytes=(body + head) * element,
            num_layers=len(model.layer_specs()),
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            element_size=element,
        )

    def kv_bytes(self, num_slots: int) -> int:
        """Bytes of K and V for ``num_slots`` slots summed over layers."""
        return 2 * num_slots * self.num_kv_heads * self.head_dim * self.element_size

    def prefill_flops(self, batch: int, context: int) -> float:
        """Matmul + causal attention FLOPs of prefilling ``batch`` prompts of ``context``."""
        attention = 2 * self.num_layers * self.num_heads * self.head_dim * context * (context + 1)
        return batch * (2 * self.body_params * context + attention + 2 * self.head_params)

    def decode_flops(self, batch: int, num_slots: int) -> float:
        """FLOPs of one decode step: matmuls per request + QK and PV over the held slots."""
        attention = 4 * num_slots * self.num_heads * self.head_dim
        return 2 * batch * (self.body_params + self.head_params) + attention


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench roofline", __doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests")
    parser.add_argument("--context", type=int, default=2000, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps")
    parser.add_argument("--repeats", type=int, default=3, help="machine probe repeats")
    common.add_common_args(parser, "reports/roofline.json")
    add_engine_args(parser)
    return parser


def held_slots(engine, request_ids) -> int:
    """K/V slots held by ``request_ids``, summed over layers."""
    return sum(sum(engine.kv.get(r).kept_per_layer()) for r in request_ids if engine.kv.has(r))


def time_workload(engine, batch: int, context: int, steps: int, vocab: int, avoid) -> dict:
    """Prefill ``batch`` random prompts, then time ``steps`` decode steps.

    Returns:
        ``prefill_s`` (until every request has its first token), ``decode_s`` (per timed step)
        and ``slots`` (K/V slots held before each timed step).
    """
    prompts = common.random_prompts(batch, context, vocab, seed=batch, avoid=avoid)
    # Requests prefilled early decode while later ones prefill: room for every prefill step, so
    # that all ``batch`` requests are still running in the timed steps (aborted afterwards).
    params = SamplingParams(max_tokens=steps + batch + 16, temperature=0.0, ignore_eos=True)
    ids = [f"roofline-{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params, None)
    num_out: dict[str, int] = {}

    def step() -> float:
        start = time.perf_counter()
        for output in engine.step():
            num_out[output.request_id] = len(output.outputs[0].token_ids)
        return time.perf_counter() - start

    prefill_s = 0.0
    while len(num_out) < batch or min(num_out.values()) < 1:
        prefill_s += step()
    step()  # first decode step: untimed
    decode_s, slots = [], []
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        slots.append(held_slots(engine, ids))
        decode_s.append(step())
    running = sum(1 for request_id in ids if engine.kv.has(request_id))
    for request_id in ids:
        engine.abort_request(request_id)
    if running < batch:
        raise RuntimeError(f"only {running} of {batch} requests held KV in the timed steps")
    return {"prefill_s": prefill_s, "decode_s": decode_s, "slots": slots}


def bounds_row(shape: ModelShape, machine: dict, dtype: str, batch: int, context: int, timing):
    """One report row: measured times, lower bounds and their ratios."""
    bandwidth = machine["read_bandwidth"]
    peak = machine["matmul_flops"][dtype]
    slots = statistics.fmean(timing["slots"])
    decode_bytes = shape.weight_bytes + shape.kv_bytes(round(slots))
    decode_bound = max(decode_bytes / bandwidth, shape.decode_flops(batch, round(slots)) / peak)
    prefill_bound = shape.prefill_flops(batch, context) / peak
    decode_s = statistics.median(timing["decode_s"])
    return {
        "batch": batch,
        "context": context,
        "prefill_s": timing["prefill_s"],
        "prefill_bound_s": prefill_bound,
        "prefill_fraction": prefill_bound / timing["prefill_s"],
        "decode_step_ms": 1000 * decode_s,
        "decode_bound_ms": 1000 * decode_bound,
        "decode_fraction": decode_bound / decode_s,
        "decode_weight_mb": shape.weight_bytes / 1e6,
        "decode_kv_mb": shape.kv_bytes(round(slots)) / 1e6,
        "decode_tok_per_s": batch / decode_s,
    }


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Probe the machine, time the engine per batch, print and write the report."""
    from sparsekv.bench.kernels import measure_machine

    args = build_parser().parse_args(argv)
    if args.context < 1 or args.steps < 1 or min(args.batch) < 1:
        raise ValueError("context, steps and every batch must be >= 1")
    common.apply_threads(args.threads)
    load_start = common.load_average()
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    machine = measure_machine(args.repeats)
    engine = common.build_engine(config, checkpoint)
    dtype_name = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}[str(engine.parts.dtype)]
    shape = ModelShape.of(engine.parts.model)
    vocab = checkpoint.hf_config.vocab_size
    avoid = common.special_token_ids(checkpoint.tokenizer)
    common.warm_up(engine, vocab)
    rows = []
    for batch in args.batch:
        timing = time_workload(engine, batch, args.context, args.steps, vocab, avoid)
        rows.append(bounds_row(shape, machine, dtype_name, batch, args.context, timing))
    settings = {k: v for k, v in vars(args).items() if "__" not in k}
    document: dict[str, Any] = {
        "machine": machine | {"dtype": dtype_name},
        "model": vars(shape),
        "rows": rows,
        "provenance": common.bench_provenance(config, settings, load_start),
    }
    path = common.write_json(args.output, document)
    print(
        f"read bandwidth {machine['read_bandwidth'] / 1e9:.1f} GB/s, "
        f"{dtype_name} matmul {machine['matmul_flops'][dtype_name] / 1e9:.1f} GFLOP/s"
    )
    columns = ("batch", "context", "prefill_s", "prefill_bound_s", "prefill_fraction")
    columns += ("decode_step_ms", "decode_bound_ms", "decode_fraction", "decode_kv_mb")
    print(common.format_table(rows, columns))
    print(f"wrote {path}")
    return 0
