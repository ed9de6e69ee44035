"""Which budgeted layer must keep a RULER needle: answers when the needle's tokens are forced
into the kept set of chosen layers, the rest scored as the policy scores them.

Each sample of ``--task`` runs query-agnostic (``scope: "context"``: the context compressed
before the question) with ``--method`` at ``--ratio``. For every entry of ``--force`` (``none``,
or budgeted-layer positions joined by ``+``: ``0`` is the lowest budgeted layer; Gemma 3 270M's
0, 1, 2 are its global layers 5, 11, 17) the compressor's scores of the needle's tokens and
their ``--pad`` neighbours are set to ``+inf`` in those layers, and the script prints how many
samples the model then answers. ``--force none`` is the policy alone.

    PYTHONPATH=. .venv/bin/python scripts/needle_layer_oracle.py --task niah_single_2 \
        --samples 10 --force none,0+1+2,1,2
"""

from __future__ import annotations

import argparse

import torch

from sparsekv.compression.base import Compressor
from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, ModelConfig
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.evaluation import ruler_run
from sparsekv.loader import load_checkpoint
from sparsekv.sampling_params import SamplingParams


def needle_positions(tokenizer, case) -> list[int]:
    """Context positions of the answers' tokens (with and without a leading space)."""
    ids, found = case.prompt_ids[: case.context_tokens], set()
    for answer in case.sample.answers:
        for text in (answer, " " + answer):
            tokens = tokenizer.encode(text, add_special_tokens=False)
            for start in range(len(ids) - len(tokens) + 1):
                if ids[start : start + len(tokens)] == tokens:
                    found.update(range(start, start + len(tokens)))
    if not found:
        raise ValueError(f"the answers {case.sample.answers} are not in the context")
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--layer-scores", default="own", choices=("own", "first"))
    parser.add_argument("--force", default="none,0+1+2,1,2")
    parser.add_argument("--pad", type=int, default=8)
    args = parser.parse_args()

    checkpoint = load_checkpoint(args.model, torch.bfloat16)
    tokenizer = checkpoint.tokenizer
    cases = ruler_run.build_cases(tokenizer, [args.task], [4096], args.samples, 0, "completion")
    config = EngineConfig(
        model=ModelConfig(model=args.model, max_model_len=4400),
        cache=CacheConfig(kv_cache_memory=1.0, enable_prefix_caching=False),
    )
    engine = LLMEngine(config, build_engine_parts(config, checkpoint))
    state = {"call": 0, "layers": (), "positions": []}
    ranking_scores = Compressor.ranking_scores

    def forcing(self, view):
        scores = ranking_scores(self, view).clone()
        if state["call"] in state["layers"]:
            for p in state["positions"]:
                scores[:, max(0, p - args.pad) : p + args.pad + 1] = float("inf")
        state["call"] += 1
        return scores

    Compressor.ranking_scores = forcing
    for entry in args.force.split(","):
        layers = () if entry == "none" else tuple(int(x) for x in entry.split("+"))
        answered = 0
        for index, case in enumerate(cases):
            state.update(call=0, layers=layers, positions=needle_positions(tokenizer, case))
            policy = CompressionConfig(
                method=args.method,
                budget=None,
                compression_ratio=args.ratio,
                layer_scores=args.layer_scores,
                scope="context",
                context_tokens=case.context_tokens,
            )
            params = SamplingParams(max_tokens=case.max_tokens, temperature=0.0)
            engine.add_request(f"{entry}-{index}", case.prompt_ids, params, policy)
            text = ""
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        text = output.outputs[0].text
            answered += all(answer in text for answer in case.sample.answers)
        print(f"forced layers {entry}: {answered} of {len(cases)} answered", flush=True)


if __name__ == "__main__":
    main()
