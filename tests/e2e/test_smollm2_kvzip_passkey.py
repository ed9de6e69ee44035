"""KVzip on the real SmolLM2-135M: the ~900-token passkey asked as a plain chat question (no
answer prefix), 10 depths, 75% removed. Measured: 10/10 (the full cache 10/10; SnapKV with a
max-pool kernel of 7 2/10, with the default 15 10/10); the test asserts 9/10."""

from __future__ import annotations

import pytest

from sparsekv.config import CompressionConfig
from sparsekv.engine.prompts import render_chat
from sparsekv.evaluation.scoring import score_passkey
from sparsekv.evaluation.tasks import passkey
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion


@pytest.mark.slow
def test_kvzip_passkey_plain_chat_75(smollm2_checkpoint, smollm2_tokenizer):
    from sparsekv.config import CacheConfig, EngineConfig, ModelConfig
    from sparsekv.engine.engine_setup import build_engine_parts
    from sparsekv.engine.llm_engine import LLMEngine
    from tests.conftest import _REGISTRY

    config = EngineConfig(
        model=ModelConfig(dtype="float32"), cache=CacheConfig(kv_cache_memory=0.5)
    )
    engine = _REGISTRY.add(
        LLMEngine(config, build_engine_parts(config, smollm2_checkpoint)), transient=True
    )
    samples = [passkey(smollm2_tokenizer, 900, depth=(d + 0.5) / 10, seed=d) for d in range(10)]
    policy = CompressionConfig(method="kvzip", budget=None, compression_ratio=0.75)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    requests = [
        (f"z{i}", render_chat(smollm2_tokenizer, s.messages), params, policy)
        for i, s in enumerate(samples)
    ]
    done = run_to_completion(engine, requests)
    scores = [
        score_passkey(done[f"z{i}"].outputs[0].text, s.answers) for i, s in enumerate(samples)
    ]
    assert 0.6 < done["z0"].kv_stats.compression_ratio < 0.75  # 28 of 30 layers at 75%
    assert sum(s == 100 for s in scores) >= 9
