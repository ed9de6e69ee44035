"""``sparsekv calibrate``: per-layer budgets from measured attention concentration.

PyramidKV (arXiv 2406.02069) and AdaKV (arXiv 2407.11550) observe that layers differ in how
concentrated their attention is: where a few slots hold most of the mass, a small budget loses
little; where attention is spread, eviction loses much. This measures it and allocates:

1. Concentration: on a few calibration texts (real documents on this machine, see
   ``fidelity.long_texts``), the model runs with dense fp32 attention; for each layer, the
   last ``rows`` query rows of every head put a fraction of their attention mass on their top
   ``ceil((1 - r) * n)`` slots (``r`` the compression ratio): ``c_l`` is its mean.
2. Need: ``1 - c_l``, the mass a layer loses at a flat budget.
3. Allocation: fractions ``f_l = clip(lambda * need_l, floor, 1)`` over the compressible
   layers, ``lambda`` chosen so that they sum to ``(1 - r)`` times their count (the flat
   policy's total); layers that reach 1 are kept whole, chosen by measurement.

The result is a budgets file (``compression.budgets_file``) for ``--kv-layer-budgets-file``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

import torch

from sparsekv.bench import common
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.compression.budgets_file import LayerBudgets, save_budgets
from sparsekv.evaluation.fidelity import long_texts


class ConcentrationProbe:
    """Attention context for ``model.forward`` of one sequence: dense fp32 causal attention
    (the model's sliding windows and soft-cap applied), measuring each layer's top-slot mass.

    Args:
        keep: fraction of the slots counted as kept, in ``(0, 1]``.
        rows: last query rows measured.
        logit_softcap: the model's attention soft-cap, or ``None``.
    """

    def __init__(self, keep: float, rows: int, logit_softcap: float | None = None) -> None:
        self.keep, self.rows, self.softcap = keep, rows, logit_softcap
        self.top_mass: dict[int, float] = {}

    def attend(self, layer, q, k, v, scale, sliding_window=None):
        dtype = q.dtype  # the output goes back to the model's compute dtype
        q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [heads, T, d]
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        logits = q @ k.transpose(1, 2) * scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        size = logits.shape[-1]
        index = torch.arange(size)
        visible = index[None, :] <= index[:, None]
        if sliding_window is not None:
            visible &= index[None, :] > index[:, None] - sliding_window
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        self.top_mass[layer] = top_mass(probs[:, -self.rows :], self.keep)
        return (probs @ v).transpose(0, 1).to(dtype)


def top_mass(probs: torch.Tensor, keep: float) -> float:
    """Mean fraction of each row's mass on its top ``ceil(keep * n)`` slots.

    Args:
        probs: ``[heads, rows, n]`` softmax rows (masked slots hold 0).
        keep: fraction of the ``n`` slots kept.
    """
    k = max(1, math.ceil(keep * probs.shape[-1] - 1e-9))
    return float(probs.topk(k, dim=-1).values.sum(-1).mean())


def allocate(
    need: Sequence[float], compressible: Sequence[bool], ratio: float, floor: float = 0.02
) -> list[float]:
    """Per-layer kept fractions proportional to ``need`` under the flat policy's total.

    Args:
        need: per layer, ``>= 0`` (higher = more budget).
        compressible: per layer; other layers get 1 (full) and do not count.
        ratio: compression ratio (fraction removed), in ``[0, 1)``.
        floor: smallest fraction given to a layer.

    Returns:
        Fractions in ``[floor, 1]``; over the compressible layers they sum to ``(1 - ratio)``
        times their count (up to float rounding).

    Raises:
        ValueError: ``ratio`` out of range, or ``floor`` above ``1 - ratio``.
    """
    if not 0 <= ratio < 1:
        raise ValueError(f"compression_ratio: must be in [0, 1), got {ratio}")
    if not 0 < floor <= 1 - ratio:
        raise ValueError(f"floor: must be in (0, 1 - compression_ratio], got {floor}")
    layers = [i for i, can in enumerate(compressible) if can]
    total = (1 - ratio) * len(layers)
    weights = [max(float(need[i]), 1e-12) for i in layers]

    def spread(scale: float) -> list[float]:
        return [min(1.0, max(floor, scale * w)) for w in weights]

    low, high = 0.0, 1.0
    while sum(spread(high)) < total:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(spread(mid)) < total else (low, mid)
    fractions = [1.0] * len(need)
    for layer, value in zip(layers, spread(high)):
        fractions[layer] = value
    return fractions


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv calibrate", __doc__)
    parser.add_argument("--output", required=True, metavar="PATH", help="budgets file to write")
    parser.add_argument("--ratio", type=float, default=0.75, help="fraction removed (0.75)")
    parser.add_argument("--texts", type=int, default=4, help="calibration texts (4)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per text (1024)")
    parser.add_argument("--rows", type=int, default=64, help="last query rows measured (64)")
    parser.add_argument("--floor", type=float, default=0.02, help="smallest layer fraction")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Measure, allocate and write the budgets file; prints one line per layer."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.texts < 1 or args.tokens < 2 or args.rows < 1:
        raise ValueError("texts, tokens and rows must be positive")
    if not 0 <= args.ratio < 1:  # NaN too
        raise ValueError(f"ratio: must be in [0, 1), got {args.ratio}")
    common.apply_threads(args.threads)
    config = engine_config_from_args(args)
    checkpoint = common.load_checkpoint(config, checkpoint)
    engine = common.build_engine(config, checkpoint)
    model, specs = engine.parts.model, engine.kv.layer_specs
    keep = 1 - args.ratio
    sums = [0.0] * len(specs)
    texts = long_texts(engine.tokenizer, min_tokens=args.tokens, count=args.texts)
    if not texts:
        raise ValueError(
            f"tokens: no calibration text on this machine has {args.tokens} tokens; lower --tokens"
        )
    for _, text in texts:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
        probe = ConcentrationProbe(keep, args.rows, getattr(model, "attn_logit_softcap", None))
        with torch.inference_mode():
            model(torch.tensor(ids), torch.arange(len(ids)), probe)
        for layer, mass in probe.top_mass.items():
            sums[layer] += mass / len(texts)
    compressible = [spec.compressible for spec in specs]
    fractions = allocate([1 - c for c in sums], compressible, args.ratio, args.floor)
    extra = {
        "model": config.model.model,
        "compression_ratio": args.ratio,
        "calibration": {
            "texts": [name for name, _ in texts],
            "tokens": args.tokens,
            "rows": args.rows,
            "top_mass": [round(c, 6) for c in sums],
        },
    }
    save_budgets(args.output, LayerBudgets("fractions", tuple(fractions), extra))
    for layer, (c, f) in enumerate(zip(sums, fractions)):
        print(f"layer {layer:3d}  top-{keep:.0%} mass {c:.3f}  kept fraction {f:.3f}")
    print(f"wrote {args.output}")
    return 0
