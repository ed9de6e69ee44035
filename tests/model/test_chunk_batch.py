"""Several verifying requests of one step attend in one batched call per layer
(``runner.chunk_batch``, the cpu backend's ``prefill_attention_paged_batch``), with greedy
output equal to plain decoding token for token (tiny random fp32 models, n-gram drafts)."""

from __future__ import annotations

import pytest

from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import build
from sparsekv.config import CompressionConfig
from sparsekv.sampling_params import SamplingParams
from tests.model.spec_models import NGRAM, engine, generate, repetitive_prompts, token_ids
from tests.model.spec_models import tiny_checkpoint as spec_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)
SNAPKV = CompressionConfig(method="snapkv", budget=24, window=8, full_layers=1)


@pytest.fixture(scope="module")
def checkpoint():
    return spec_checkpoint("qwen2", seed=1)


@pytest.mark.parametrize("compression", [None, SNAPKV], ids=["full", "snapkv"])
def test_verifying_requests_share_one_call_per_layer(checkpoint, compression, monkeypatch):
    if build.native_disabled() or build.load_extension() is None:
        pytest.skip("the batched chunk kernel is native")
    batches = []
    batched = CpuNativeBackend.prefill_attention_paged_batch

    def spy(self, *args, **kwargs):
        result = batched(self, *args, **kwargs)
        batches.append((args[4].shape[0], result is not None))
        return result

    monkeypatch.setattr(CpuNativeBackend, "prefill_attention_paged_batch", spy)
    prompts = repetitive_prompts([40, 13, 55, 29])
    params = [SamplingParams(max_tokens=24, **GREEDY) for _ in prompts]
    plain = token_ids(generate(engine(checkpoint, compression=compression), prompts, params))
    spec = engine(checkpoint, speculative=NGRAM, compression=compression)
    assert isinstance(spec.runner.backend, CpuNativeBackend)
    assert token_ids(generate(spec, prompts, params)) == plain
    assert any(size >= 2 and ran for size, ran in batches), batches
