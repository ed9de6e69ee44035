"""Kept indices on the real SmolLM2-135M: per layer and KV head, the slots the engine
keeps at the end of a 700-token prompt equal the exact top-k of the brute-force dense reference
(``dense_reference.DenseMaskedAttention``: float64 softmax of the window queries over every
position, max-pooled, GQA-averaged, ties to the more recent token). fp32.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.config import CompressionConfig
from sparsekv.evaluation.fidelity import long_texts
from sparsekv.kv_cache.budget import layer_budgets
from sparsekv.sampling_params import SamplingParams
from tests.conftest import record_selections
from tests.model.dense_reference import DenseMaskedAttention


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
def test_kept_indices_equal_the_brute_force_reference(
    smollm2_checkpoint, make_engine, monkeypatch, method
):
    policy = CompressionConfig(method=method, budget=256, window=32, full_layers=2)
    engine = make_engine(smollm2_checkpoint, compression=policy, prefix_caching=False)
    _, text = long_texts(engine.tokenizer, min_tokens=700, count=1)[0]
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)[:700]
    # [num_kv_heads, budget] per budgeted layer, in layer order
    kept = record_selections(monkeypatch, SnapKVCompressor)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    num_layers = len(engine.kv.layer_specs)
    budgets = layer_budgets(policy, num_layers, len(prompt), [True] * num_layers)
    assert budgets[:2] == [None, None] and len(kept) == num_layers - 2
    reference = DenseMaskedAttention(
        num_layers, budgets, 32, 16, len(prompt), policy.kernel_size, "max"
    )
    with torch.inference_mode():
        engine.parts.model(torch.tensor(prompt), torch.arange(len(prompt)), reference)
    for layer, chosen in zip(range(2, num_layers), kept):
        expected = reference.kept_positions(layer)
        assert chosen.shape[1] == budgets[layer]
        for head, positions in enumerate(expected):
            assert sorted(chosen[head].tolist()) == positions, (layer, head)


def test_adaptive_head_split_equals_the_brute_force_reference(
    smollm2_checkpoint, make_engine, monkeypatch
):
    # Ada-KV on the real model: every budgeted layer's 3 KV heads share 3 x 192 slots; the
    # per-head kept sets equal the reference's (Python sort over score, slot, head).
    policy = CompressionConfig(budget=192, window=32, full_layers=2, head_budgets="adaptive")
    engine = make_engine(smollm2_checkpoint, compression=policy, prefix_caching=False)
    _, text = long_texts(engine.tokenizer, min_tokens=700, count=1)[0]
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)[:700]
    kept = record_selections(monkeypatch, SnapKVCompressor, "select_heads")
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    num_layers = len(engine.kv.layer_specs)
    budgets = [None, None] + [192] * (num_layers - 2)
    assert len(kept) == num_layers - 2
    reference = DenseMaskedAttention(
        num_layers, budgets, 32, 16, len(prompt), policy.kernel_size, "max",
        head_budgets="adaptive",
    )  # fmt: skip
    with torch.inference_mode():
        engine.parts.model(torch.tensor(prompt), torch.arange(len(prompt)), reference)
    unequal = 0
    for layer, chosen in zip(range(2, num_layers), kept):
        assert chosen == reference.kept_positions(layer), layer
        assert sum(len(rows) for rows in chosen) == 3 * 192
        unequal += len({len(rows) for rows in chosen}) > 1
    assert unequal >= (num_layers - 2) // 2  # most layers move budget between heads
