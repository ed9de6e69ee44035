"""A whole engine on each attention backend: a 2-layer random Llama with SnapKV (prefill
compression and decode-time eviction) gives the same greedy tokens, kept slots and kept counts
on every backend as on the native CPU one, in fp32."""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.config import CompressionConfig
from sparsekv.sampling_params import SamplingParams
from tests.model.family_models import (
    checkpoint_of,
    make_engine,
    random_hf_model,
    random_prompts,
    tiny_config,
)

BACKENDS = {"cpu": CpuNativeBackend, "torch": TorchBackend}


def _run(checkpoint, backend: str, monkeypatch) -> tuple[dict, list[torch.Tensor]]:
    policy = CompressionConfig(method="snapkv", budget=40, window=8, full_layers=0)
    engine = make_engine(
        checkpoint, compression=policy, prefix_caching=False, attention_backend=backend
    )
    assert type(engine.parts.runner.backend) is BACKENDS[backend]
    assert all(type(storage.backend) is BACKENDS[backend] for storage in engine.kv.storages)
    kept = []
    select = SnapKVCompressor.select

    def recording(self, view, budget, window, scores=None):
        assert type(view.backend) is BACKENDS[backend]
        chosen = select(self, view, budget, window, scores)
        kept.append(chosen.clone())
        return chosen

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with monkeypatch.context() as patch:
        patch.setattr(SnapKVCompressor, "select", recording)
        for i, prompt in enumerate(random_prompts([100, 63], seed=4)):
            engine.add_request(f"r{i}", prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = (
                        out.outputs[0].token_ids,
                        out.kv_stats.kept_per_layer,
                    )
    return outputs, kept


@pytest.mark.parametrize("backend", ["torch"])
def test_engine_equals_the_native_backend(backend, monkeypatch):
    config = tiny_config("llama3")
    config.num_hidden_layers = 2
    checkpoint = checkpoint_of(random_hf_model(config, seed=2))
    want, want_kept = _run(checkpoint, "cpu", monkeypatch)
    got, got_kept = _run(checkpoint, backend, monkeypatch)
    assert got == want
    assert len(want_kept) > 4  # prefill compressions and decode-time evictions
    assert len(got_kept) == len(want_kept)
    for a, b in zip(got_kept, want_kept):
        assert torch.equal(a, b)
