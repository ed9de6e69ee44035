"""A method is one class and one registry line: a test-only compressor, registered with
``register_compressor``, runs end to end on a tiny model (its own budget schedule, its
capability flags read by the runner), asked for by name in a request's overrides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import sparsekv.compression_config as config_module
from sparsekv.compression import registry
from sparsekv.compression.base import LayerView
from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.config import CompressionConfig
from sparsekv.sampling_params import SamplingParams
from tests.conftest import tiny_checkpoint, tiny_llama_config


@dataclass
class SteppedSnapKV(SnapKVCompressor):
    """Test-only method: SnapKV's scores under budgets that step down by one window per
    budgeted layer, asking for the accumulated attention mass (and recording that it got it)."""

    name = "stepped_snapkv"
    needs_attention_mass = True
    seen_mass: ClassVar[list[bool]] = []

    @staticmethod
    def layer_schedule(
        budget: int, window: int, num_prompt_tokens: int, num_layers: int
    ) -> list[int]:
        return [budget + window * (num_layers - 1 - layer) for layer in range(num_layers)]

    def score(self, view: LayerView) -> torch.Tensor:
        SteppedSnapKV.seen_mass.append(view.accumulated is not None)
        return super().score(view)


@pytest.fixture
def stepped(monkeypatch):
    """``SteppedSnapKV`` registered for one test (the registry and the names restored after)."""
    monkeypatch.setattr(registry, "COMPRESSORS", dict(registry.COMPRESSORS))
    monkeypatch.setattr(config_module, "COMPRESSION_METHODS", config_module.COMPRESSION_METHODS)
    SteppedSnapKV.seen_mass.clear()
    registry.register_compressor(SteppedSnapKV)  # the one registry line
    return SteppedSnapKV


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    config = tiny_llama_config(num_heads=4, num_kv_heads=2, num_layers=4)
    return tiny_checkpoint(config, smollm2_tokenizer, seed=7)[0]


def run(engine, prompt, policy, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("q", prompt, params, policy, collect_logits=True)
    request = engine.scheduler.waiting[-1]
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    return request, final


def test_a_registered_method_runs_end_to_end(tiny, make_engine, stepped):
    prompt = torch.randint(10, 49000, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    settings = {"budget": 24, "window": 4, "full_layers": 1, "decode_eviction": False}
    engine = make_engine(tiny, block_size=4)
    request, final = run(engine, prompt, {"method": stepped.name, **settings})
    assert isinstance(request.compressor, stepped)
    assert request.policy.layer_budgets == (None, 32, 28, 24)  # the class's own schedule
    assert request.policy.needs_attention_mass and request.max_prefix_hit_tokens(True) == 0
    assert stepped.seen_mass and all(stepped.seen_mass)
    assert final.error is None and final.outputs[0].finish_reason == "length"
    # Without decode eviction each layer holds its budget plus the 11 tokens fed back.
    assert final.kv_stats.kept_per_layer == [60 + 11, 32 + 11, 28 + 11, 24 + 11]

    # SnapKV under the same explicit budgets keeps the same slots: same tokens and logits.
    same = CompressionConfig(method="snapkv", layer_budgets=(0, 32, 28, 24), **settings)
    reference, reference_final = run(make_engine(tiny, block_size=4), prompt, same)
    assert request.output_token_ids == reference.output_token_ids
    torch.testing.assert_close(
        torch.stack(request.logits), torch.stack(reference.logits), atol=1e-4, rtol=0
    )
    assert reference_final.kv_stats.kept_per_layer == final.kv_stats.kept_per_layer


def test_an_unregistered_name_is_refused(tiny, make_engine):
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match=r"^kv_compression\.method: unknown method 'stepped"):
        engine.add_request("q", [11, 12, 13], params, {"method": "stepped_snapkv"})
    assert not engine.has_unfinished_requests()


def test_registering_a_taken_name_is_refused(stepped):
    @dataclass
    class Impostor(SnapKVCompressor):
        name = "stepped_snapkv"

    with pytest.raises(ValueError, match="cannot register 'stepped_snapkv'"):
        registry.register_compressor(Impostor)
    assert registry.register_compressor(stepped) is stepped  # the same class again: a no-op
