"""Where KVzip's scores put a RULER needle: per budgeted layer, how many of the needle's tokens
fall inside the layer's budget under four scorings of the same prompt.

- ``kvzip``: sparsekv's KVzip as the engine runs it (softmax over every slot a row sees).
- ``chunk``: kvpress's normalisation (a segment's rows softmax over the 4 sinks, their own
  chunk of the context and the segment; a slot is scored by its own chunk's segment only).
- ``value``: sparsekv's probabilities times ``||W_o,h v_j||`` (the value-norm half of KVzip+).
- ``snapkv``: the default SnapKV's scores of the same slots from the prompt's last 32 queries
  (the question, in the query-aware protocol), for contrast.

The engine runs each sample once with KVzip at ``--ratio``; the compressor's ``select`` is
wrapped to keep the layer views of the compressing step and KVzip's own scores; the other three
are recomputed densely in fp32 from the same views. A needle token counts as kept when fewer
than ``budget - window`` older slots score strictly higher (ties count in its favour; the engine
breaks them towards newer slots). Also prints each layer's median score and the model's answer.

    PYTHONPATH=. .venv/bin/python scripts/kvzip_needle_ranks.py --model gemma3-270m \
        --task niah_single_2 --samples 3
"""

from __future__ import annotations

import argparse

import torch

from sparsekv.attention.torch_ref import causal_mask
from sparsekv.compression.base import LayerView
from sparsekv.compression.kvzip import KVzipCompressor
from sparsekv.compression.registry import get_compressor
from sparsekv.compression.scoring import aggregate_gqa
from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, ModelConfig
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.evaluation import ruler_run
from sparsekv.kv_cache.policy import resolve_policy
from sparsekv.loader import load_checkpoint
from sparsekv.sampling_params import SamplingParams


def segment_probs(view: LayerView, segment) -> torch.Tensor:
    """``[num_heads, rows, n + rows]`` fp32 softmax of a segment's rows over the held slots and
    the segment (causal within it)."""
    group = segment.queries.shape[0] // view.num_kv_heads
    keys = torch.cat([view.keys.float(), segment.keys.float()], dim=1)
    logits = segment.queries.float() @ keys.repeat_interleave(group, 0).transpose(1, 2)
    logits = logits * view.scale
    if view.logit_softcap:
        logits = torch.tanh(logits / view.logit_softcap) * view.logit_softcap
    visible = causal_mask(segment.queries.shape[1], keys.shape[1])
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def chunk_scores(view: LayerView, sinks: int, chunk_size: int, start: int) -> torch.Tensor:
    """``[num_kv_heads, n]``: kvpress's per-chunk normalisation (module docstring)."""
    n, heads = view.num_tokens, view.num_kv_heads
    out = torch.zeros(heads, n)
    for segment in view.reconstruction:
        probs = segment_probs(view, segment)
        end = min(start + chunk_size, n)
        kept = list(range(min(sinks, start))) + list(range(start, end))
        seen = probs[:, :, kept + list(range(n, probs.shape[-1]))]
        seen = seen / seen.sum(-1, keepdim=True)
        best = seen[:, :, len(kept) - (end - start) : len(kept)].amax(1)
        out[:, start:end] = aggregate_gqa(best, heads, "max")
        start = end
    return out


def value_scores(view: LayerView, o_weight: torch.Tensor) -> torch.Tensor:
    """``[num_kv_heads, n]``: max over rows of probability times ``||W_o,h v_j||``."""
    n, heads, dim = view.num_tokens, view.num_kv_heads, view.keys.shape[-1]
    num_heads = view.reconstruction[0].queries.shape[0]
    group = num_heads // heads
    norms = torch.stack(
        [
            (view.values[h // group].float() @ o_weight[:, h * dim : (h + 1) * dim].T).norm(dim=-1)
            for h in range(num_heads)
        ]
    )
    best = torch.zeros(num_heads, n)
    for segment in view.reconstruction:
        probs = segment_probs(view, segment)[:, :, :n]
        best = torch.maximum(best, (probs * norms[:, None, :]).amax(1))
    return aggregate_gqa(best, heads, "max")


def inside_budget(
    scores: torch.Tensor, positions: list[int], budget: int, sinks: int, window: int
) -> int:
    """How many ``positions`` (older than the observation window) rank among the
    ``budget - window`` best older slots; the sinks always stay."""
    older = scores[: scores.shape[0] - window].clone()
    older[:sinks] = float("inf")
    return sum(int((older > older[j]).sum()) < budget - window for j in positions)


def main() -> None:
    """Run ``--samples`` RULER samples of ``--task`` with KVzip and print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--prompt-format", default="completion")
    args = parser.parse_args()
    torch.set_num_threads(1)

    checkpoint = load_checkpoint(args.model, torch.bfloat16)
    tokenizer = checkpoint.tokenizer
    cases = ruler_run.build_cases(
        tokenizer, [args.task], [4096], args.samples, 0, args.prompt_format
    )
    config = EngineConfig(
        model=ModelConfig(model=args.model, max_model_len=4300),
        cache=CacheConfig(kv_cache_memory=1.0),
    )
    engine = LLMEngine(config, build_engine_parts(config, checkpoint))
    compressor = KVzipCompressor()
    compressor.bind(tokenizer)
    prefix = list(compressor.repeat.template_prefix)

    seen: list[tuple[LayerView, torch.Tensor, int]] = []
    select = KVzipCompressor.select

    def recording(self, view, budget, window, scores=None):
        if view.reconstruction:
            seen.append((view, self.score(view), budget))
        return select(self, view, budget, window, scores)

    KVzipCompressor.select = recording
    snapkv = get_compressor(CompressionConfig(method="snapkv"))
    totals = dict(kvzip=0, chunk=0, value=0, snapkv=0, tokens=0)
    for index, case in enumerate(cases):
        seen.clear()
        # The paper's scores (unpooled, the group's max), as the other columns are computed.
        policy = CompressionConfig(
            method="kvzip",
            budget=None,
            compression_ratio=args.ratio,
            pooling="none",
            gqa_agg="max",
        )
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0.0)
        resolved = resolve_policy(
            config, policy, engine.kv, len(case.prompt_ids), case.max_tokens, 0, tokenizer
        )
        budgeted = [i for i, b in enumerate(resolved.layer_budgets) if b is not None]
        # Segments reconstruct the context after the chat template's prefix, where it has one.
        start = len(prefix) if prefix and case.prompt_ids[: len(prefix)] == prefix else 0
        engine.add_request(f"s{index}", case.prompt_ids, params, policy)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        answer = [o for o in outputs if o.finished][0].outputs[0].text
        needle = []
        ids = case.prompt_ids
        for text in case.sample.answers:
            tokens = tokenizer.encode(text, add_special_tokens=False)
            for i in range(case.context_tokens - len(tokens) + 1):
                if ids[i : i + len(tokens)] == tokens:
                    needle += range(i, i + len(tokens))
        if not needle or max(needle) >= len(ids) - resolved.window:
            raise ValueError(f"sample {index}: the answer's tokens are not found in the context")
        if len(seen) != len(budgeted):
            raise RuntimeError(f"{len(seen)} compressions for {len(budgeted)} budgeted layers")
        print(f"sample {index}: answers {case.sample.answers}, model said {answer!r}")
        for (view, scores, budget), layer in zip(seen, budgeted):
            o_weight = _dense_weight(engine.parts.model.layers[layer].self_attn.o_proj)
            scorings = dict(
                kvzip=scores,
                chunk=chunk_scores(view, compressor.sinks, compressor.chunk_size, start),
                value=value_scores(view, o_weight),
                snapkv=snapkv.score(view),
            )
            row = {
                key: sum(
                    inside_budget(head, needle, budget, compressor.sinks, resolved.window)
                    for head in per_head
                )
                for key, per_head in scorings.items()
            }
            for key, value in row.items():
                totals[key] += value
            totals["tokens"] += len(needle) * view.num_kv_heads
            finite = scores[torch.isfinite(scores)]
            print(
                f"  layer {layer}: budget {budget} of {view.num_tokens}, median score "
                f"{finite.median():.4f}; needle tokens inside the budget, of {len(needle)} x "
                f"{view.num_kv_heads} heads: " + ", ".join(f"{k} {v}" for k, v in row.items())
            )
    print("needle tokens inside the budget, all samples and layers:", totals)


def _dense_weight(linear) -> torch.Tensor:
    """``[out, in]`` fp32 weight of a (possibly packed) bias-free linear layer, by applying it
    to the identity."""
    if getattr(linear, "bias", None) is not None:
        raise ValueError("the output projection has a bias: its weight cannot be read this way")
    with torch.inference_mode():
        eye = torch.eye(linear.in_features, dtype=torch.bfloat16)
        return linear(eye).float().T


if __name__ == "__main__":
    main()
