"""Sparse self-speculation on SmolLM2-135M-Instruct (fp32): greedy output equals plain decoding
with compression off and on, and with drafts from the first 8192 token ids only, in a batch with
a plain request, while the draft view leaves out most of each prompt's pages and drafts are
still accepted."""

from __future__ import annotations

import dataclasses

import pytest

from sparsekv.config import CompressionConfig, SpeculativeConfig
from sparsekv.engine.prompts import render_chat
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion

SELF = SpeculativeConfig(
    method="sparse_self", num_speculative_tokens=3, draft_sink_tokens=16, draft_recent_tokens=64
)
SNAPKV = CompressionConfig(method="snapkv", budget=160, window=16, full_layers=2)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\n"
)


def _prompt(tokenizer, copies: int, task: str) -> list[int]:
    module = "".join(CODE.replace("def mean", f"def mean_{i}") for i in range(copies))
    content = f"Here is a Python module:\n\n{module}\n{task}"
    return render_chat(tokenizer, [{"role": "user", "content": content}])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("compression", "draft_vocab_size"),
    [(None, 0), (SNAPKV, 0), (None, 8192)],
    ids=["full", "snapkv", "full-vocab8192"],
)
def test_greedy_equals_plain(
    make_engine, smollm2_checkpoint, smollm2_tokenizer, compression, draft_vocab_size
):
    prompts = [
        _prompt(smollm2_tokenizer, 11, "Repeat the function mean_3 exactly."),
        _prompt(smollm2_tokenizer, 9, "Add type hints to mean_0 and print it."),
    ]
    assert all(len(p) > 300 for p in prompts)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    opted_out = SamplingParams(
        max_tokens=32, temperature=0.0, ignore_eos=True, speculative={"method": None}
    )
    requests = [("a", prompts[0], params), ("b", prompts[1], opted_out), ("c", prompts[1], params)]
    plain_engine = make_engine(smollm2_checkpoint, compression=compression)
    plain = run_to_completion(plain_engine, requests)
    speculative = dataclasses.replace(SELF, draft_vocab_size=draft_vocab_size)
    spec_engine = make_engine(smollm2_checkpoint, compression=compression, speculative=speculative)
    spec = run_to_completion(spec_engine, requests)
    for request_id in "abc":
        assert spec[request_id].outputs[0].token_ids == plain[request_id].outputs[0].token_ids
    stats = spec_engine.stats.spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
