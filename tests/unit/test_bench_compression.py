"""``sparsekv bench compression`` end to end on a tiny random Llama (no timing asserts)."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.bench import compression
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The commands run with ``--threads 1`` (tiny ops); give the session its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_quick_side_by_side_full_snapkv_pyramidkv(tmp_path, smollm2_tokenizer):
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=5)
    out = tmp_path / "compression.json"
    argv = ["--quick", "--num-prompts", "3", "--input-len", "96", "--output-len", "4"]
    argv += ["--kv-budget", "24", "--kv-window", "8", "--kv-full-layers", "1"]
    argv += [
        "--methods",
        "snapkv,pyramidkv",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--output",
        str(out),
    ]
    assert compression.main(argv, checkpoint=checkpoint) == 0
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert [r["policy"] for r in rows] == ["full", "snapkv-b24", "pyramidkv-b24"]
    # --quick pool: 2.5 full-cache requests of 3 layers x ceil(100 / 16) pages.
    assert all(r["pages_total"] == 53 for r in rows)
    for row in rows:
        assert row["output_tokens"] == 3 * 4
        assert 0 < row["peak_pages_used"] <= row["pages_total"]
        assert 1 <= row["peak_running"] <= 3
        assert row["num_preemptions"] >= 0
        assert row["ttft_p50_s"] <= row["ttft_p90_s"]
        assert 0 <= row["compression_ratio"] < 1
    # 0, or 1/100 where the last generated token (never cached) counts in num_tokens.
    assert rows[0]["compression_ratio"] <= 1 / 100 + 1e-9
    assert rows[1]["compression_ratio"] > 0.3 and rows[2]["compression_ratio"] > 0.3
    assert rows[1]["peak_pages_used"] < rows[0]["peak_pages_used"]
    assert len(document["provenance"]["notes"]) == 2
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
