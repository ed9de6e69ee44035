"""``sparsekv bench fidelity`` end to end on a tiny random Llama and real local texts."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.bench import fidelity
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The commands run with ``--threads 1`` (tiny ops); give the session its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_grid_full_vs_full_is_exact_and_compressed_rows_are_sane(tmp_path, smollm2_tokenizer):
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=9)
    out = tmp_path / "fidelity.json"
    argv = ["--num-texts", "2", "--input-len", "64", "--output-len", "8"]
    argv += ["--methods", "none,snapkv,streaming_llm", "--ratios", "0.5,0.75"]
    argv += ["--kv-window", "8", "--kv-full-layers", "1", "--dtype", "float32", "--threads", "1"]
    argv += ["--no-progress", "--output", str(out)]
    assert fidelity.main(argv, checkpoint=checkpoint) == 0
    document = json.loads(out.read_text())
    rows = {(r["method"], r["ratio"]): r for r in document["rows"]}
    assert set(rows) == {
        ("none", 0.0),
        ("snapkv", 0.5),
        ("snapkv", 0.75),
        ("streaming_llm", 0.5),
        ("streaming_llm", 0.75),
    }
    assert rows["none", 0.0]["agreement"] == 1.0
    assert rows["none", 0.0]["kl"] == pytest.approx(0.0, abs=1e-9)
    # 0, or 1/72 where the last generated token (never cached) counts in num_tokens.
    assert rows["none", 0.0]["compression_ratio"] <= 1 / 72 + 1e-9
    for (method, ratio), row in rows.items():
        assert row["num_texts"] == 2
        assert 0.0 <= row["agreement_min"] <= row["agreement"] <= 1.0
        assert row["kl"] >= 0.0
        if method != "none":
            # 2 of 3 layers budgeted at ceil((1 - r) * 64) of 72 tokens (8 generated).
            assert 0.2 < row["compression_ratio"] < ratio
    texts = json.loads(out.with_name("fidelity_texts.json").read_text())["rows"]
    assert len(texts) == 2 * 5
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()


def test_quick_grid_defaults():
    args = fidelity.build_parser().parse_args(["--quick"])
    from sparsekv.config import CompressionConfig

    cells = fidelity.grid(args, CompressionConfig())
    assert [(m, r) for m, r, _ in cells] == [
        (m, r) for m in ("snapkv", "streaming_llm", "random") for r in (0.5, 0.9)
    ]
    assert all(p.budget is None and p.compression_ratio == r for _, r, p in cells)
