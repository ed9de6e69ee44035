"""SnapKV kept indices per family: at the end of a 100-token prompt, per budgeted layer and KV
head, the slots the engine keeps equal the exact top-k of the brute-force dense reference
(``dense_reference.DenseMaskedAttention``: float64 softmax of the window queries over every
position, max-pooled, GQA-averaged, ties to the more recent token). fp32.

Gemma 2's scores come from soft-capped logits (cap 4 on random weights, where it binds): the
test also shows that uncapped scores would keep other slots, so the cap is really carried through
the engine's scoring.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.config import CompressionConfig
from sparsekv.kv_cache.budget import layer_budgets
from sparsekv.sampling_params import SamplingParams
from tests.conftest import record_selections
from tests.model.dense_reference import DenseMaskedAttention
from tests.model.family_models import (
    checkpoint_of,
    make_engine,
    random_hf_model,
    random_prompts,
    tiny_config,
)

BUDGET, WINDOW_Q, PROMPT = 40, 8, 100
# Mistral with a window past max_model_len: full layers, so compressible.
CASES = ["llama3", "qwen2", "qwen3", "mistral-full", "phi3-long", "gemma2"]


def _config(name: str):
    if name == "mistral-full":
        config = tiny_config("mistral")
        config.sliding_window = 4096  # past max_position_embeddings (512): full layers
        return config, None
    return tiny_config(name), None


def _engine_kept(checkpoint, prompt, max_len, monkeypatch):
    """Kept slots ``[num_kv_heads, budget]`` of every compressed layer, in layer order."""
    policy = CompressionConfig(method="snapkv", budget=BUDGET, window=WINDOW_Q, full_layers=0)
    engine = make_engine(checkpoint, max_len=max_len, compression=policy, prefix_caching=False)
    kept = record_selections(monkeypatch, SnapKVCompressor)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    specs = engine.kv.layer_specs
    budgets = layer_budgets(policy, len(specs), len(prompt), [s.compressible for s in specs])
    return engine, kept, budgets


def _reference_kept(engine, prompt, budgets, softcap):
    reference = DenseMaskedAttention(
        len(budgets),
        budgets,
        WINDOW_Q,
        4,
        len(prompt),
        CompressionConfig().kernel_size,
        "max",
        logit_softcap=softcap,
    )
    with torch.inference_mode():
        engine.parts.model(torch.tensor(prompt), torch.arange(len(prompt)), reference)
    return {layer: reference.kept_positions(layer) for layer, b in enumerate(budgets) if b}


@pytest.mark.parametrize("name", CASES)
def test_snapkv_kept_indices_equal_the_dense_reference(name, monkeypatch):
    config, max_len = _config(name)
    checkpoint = checkpoint_of(random_hf_model(config, seed=5))
    [prompt] = random_prompts([PROMPT], seed=11)
    engine, kept, budgets = _engine_kept(checkpoint, prompt, max_len, monkeypatch)
    if name == "mistral-full":
        assert not any(spec.is_sliding for spec in engine.kv.layer_specs)
    budgeted = [layer for layer, budget in enumerate(budgets) if budget is not None]
    assert budgeted and len(kept) == len(budgeted)
    softcap = engine.parts.model.attn_logit_softcap
    expected = _reference_kept(engine, prompt, budgets, softcap)
    for layer, chosen in zip(budgeted, kept):
        assert chosen.shape[1] == BUDGET
        for head, positions in enumerate(expected[layer]):
            assert chosen[head].tolist() == positions, (name, layer, head)
    if name == "gemma2":
        assert softcap == 4.0 and budgeted == [1]  # the global layer
        uncapped = _reference_kept(engine, prompt, budgets, None)
        assert uncapped != expected
