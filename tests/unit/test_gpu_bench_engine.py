"""The GPU check's engine benchmark (``scripts/gpu_bench_engine.py``) at tiny scale on the CPU:
it runs end to end with the carried tokenizer and random weights, writes its JSON, and its
import chain needs none of the packages the GPU machine lacks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu_scripts import run_gpu_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_bench_engine.py"


@pytest.mark.slow
def test_smoke_run_writes_every_point_without_server_packages(tmp_path):
    out = tmp_path / "engine.json"
    result = run_gpu_script("gpu_bench_engine.py", "--smoke", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(out.read_text())
    runs = document["runs"]
    assert runs[0]["model"] == "smoke-llama" and runs[0]["build_s"] > 0
    points = [(r["method"], r["concurrency"]) for r in runs[1:]]
    assert points == [("none", 1), ("snapkv", 1), ("none", 2), ("snapkv", 2)]
    for run in runs[1:]:
        assert run["output_tokens"] == 4 * run["concurrency"]
        assert run["output_tok_s"] > 0 and 0 < run["ttft_p50_s"] <= run["ttft_max_s"]
        # 40-token prompts, budget 24: SnapKV keeps at most 24 + 4 slots of 44 per layer.
        if run["method"] == "snapkv":
            assert 0 < run["compression_ratio_mean"] < 0.7
        else:
            assert run["compression_ratio_mean"] in (0.0, 1.0)
    assert set(document["snapkv_over_full"]) == {"smoke-llama@1", "smoke-llama@2"}


def test_random_state_dict_makes_tensors_on_access():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_bench_engine as bench
    finally:
        sys.path.pop(0)
    checkpoint = bench.random_checkpoint(
        "t", bench.SMOKE_MODEL, torch.float32, "cpu", bench.load_tokenizer()
    )
    weights = checkpoint.state_dict
    assert len(weights) == 2 + 2 * 9 + 1  # embeddings, 9 per layer, final norm, head
    assert weights["model.embed_tokens.weight"].shape == (512, 64)
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (64, 64) and 0.015 < float(q.std()) < 0.025
    assert checkpoint.hf_config.rope_parameters["rope_theta"] == 10000.0
    tokenizer = checkpoint.tokenizer
    assert tokenizer.eos_token_id == 0 and tokenizer.decode([3, 5, 100000]) == "<3> <5>"
