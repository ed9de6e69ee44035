"""``--prefill-qk-dtype int8`` on the real SmolLM2: the bf16 engine whose prefill logits are
int8 (``csrc/prefill_qk8.h``), teacher-forced on the greedy tokens of the same bf16 engine
with bf16 logits, on 8 real texts of 600 tokens (32 forced tokens each).

Measured on the AMD Zen 4 test machine: 0.984 mean agreement (worst text 0.969) here; with
the harness of ``test_weight_dtype.py`` (8 texts, against the dense fp32 engine) 0.980 at 128
and at 1500 tokens, as the bf16 engine's own 0.975 / 0.980. Floor 0.95. A spy checks that every
prompt token of the 30 layers went through the int8 kernel. The kernel runs on the
``avx512_bf16`` variant, forced here so that AMX CPUs test it too.
"""

from __future__ import annotations

import pytest

from sparsekv.attention.cpu import ops, prefill_ops
from sparsekv.bench import common
from sparsekv.bench.fidelity import full_runs
from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, ModelConfig
from tests.forced_agreement import forced_agreement, real_prompts

pytestmark = [pytest.mark.slow, pytest.mark.kernel_variant("prefill", "avx512_bf16")]
NUM_TEXTS, PROMPT_LEN, FORCED, LAYERS = 8, 600, 32, 30
AGREEMENT_FLOOR = 0.95


def _config(prefill_qk_dtype: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(dtype="bfloat16", prefill_qk_dtype=prefill_qk_dtype),
        cache=CacheConfig(kv_cache_memory=0.25),
        compression=CompressionConfig(method="none"),
    )


def test_int8_logits_agree_with_bf16_logits(smollm2_checkpoint, monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV, "avx512_bf16")
    prompts = real_prompts(smollm2_checkpoint.tokenizer, PROMPT_LEN, NUM_TEXTS)
    references = full_runs(
        common.build_engine(_config("auto"), smollm2_checkpoint), prompts, FORCED, None
    )

    int8_rows = []
    real = prefill_ops.prefill_attention

    def spy(query, key, value, scale, sliding_window=None, isa=None, qk_int8=False):
        if qk_int8 and prefill_ops.prefill_qk_int8_runs(query.dtype, isa):
            int8_rows.append(query.shape[1])
        return real(query, key, value, scale, sliding_window, isa, qk_int8)

    monkeypatch.setattr(prefill_ops, "prefill_attention", spy)
    engine = common.build_engine(_config("int8"), smollm2_checkpoint)
    agreement, per_text = forced_agreement(engine, prompts, references)
    assert len(per_text) == NUM_TEXTS and all(len(references[k][0]) == FORCED for k in per_text)
    assert sum(int8_rows) >= NUM_TEXTS * PROMPT_LEN * LAYERS
    assert agreement >= AGREEMENT_FLOOR, per_text
