"""``sparsekv bench spec-decode`` end to end on a tiny random Llama (no timing asserts)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from sparsekv.bench import spec_decode
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The command runs with ``--threads 1``; give the session its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_plain_and_ngram_rows_per_batch_size(tmp_path, smollm2_tokenizer):
    checkpoint = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]
    out = tmp_path / "spec.json"
    argv = [
        *("--dtype", "float32", "--threads", "1", "--kv-cache-memory", "0.05"),
        *("--kv-compression", "none", "--batch-sizes", "1,2", "--output-len", "6"),
        *("--no-warmup", "--output", str(out)),
    ]
    assert spec_decode.main(argv, checkpoint=checkpoint) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["batch_size"]) for r in rows] == [
        ("plain", 1),
        ("ngram", 1),
        ("plain", 2),
        ("ngram", 2),
    ]
    assert all(r["output_tokens"] == 6 * r["batch_size"] for r in rows)
    assert rows[0]["mean_accepted_length"] is None  # the plain run drafts nothing
    assert rows[0]["draft_ms_per_step"] is None and rows[0]["verify_ms_per_step"] is None
    for row in rows[1::2]:  # timed per verifying step, where there was one
        drafted = row["mean_accepted_length"] is not None
        assert (row["verify_ms_per_step"] is not None) == drafted
        assert not drafted or (row["draft_ms_per_step"] >= 0 and row["verify_ms_per_step"] > 0)
    assert all(r["same_tokens"] == f"{r['batch_size']}/{r['batch_size']}" for r in rows[1::2])
    assert (tmp_path / "spec.md").read_text().startswith("# Speculative decoding")


def test_bad_batch_sizes_raise(tmp_path, smollm2_tokenizer):
    checkpoint = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]
    argv = ["--batch-sizes", "0", "--output", str(tmp_path / "x.json"), "--no-warmup"]
    with pytest.raises(ValueError, match="batch_sizes"):
        spec_decode.main(argv, checkpoint=checkpoint)


def test_rounds_report_medians_and_the_median_paired_speedup(tmp_path, smollm2_tokenizer):
    checkpoint = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]
    out = tmp_path / "spec.json"
    argv = [
        *("--dtype", "float32", "--threads", "1", "--kv-cache-memory", "0.05"),
        *("--kv-compression", "none", "--batch-sizes", "1", "--output-len", "4"),
        *("--rounds", "3", "--no-warmup", "--output", str(out)),
    ]
    assert spec_decode.main(argv, checkpoint=checkpoint) == 0
    plain, spec = json.loads(out.read_text())["rows"]
    assert len(spec["speedup_rounds"]) == 3
    assert spec["speedup"] == pytest.approx(statistics.median(spec["speedup_rounds"]), abs=1e-4)
    assert plain["output_tokens"] == spec["output_tokens"] == 4 and spec["same_tokens"] == "1/1"


def test_median_row_takes_each_figure_over_the_runs():
    runs = [
        {"system": "plain", "output_tok_s": 10.0, "wall_s": 3.0, "draft_ms_per_step": None},
        {"system": "plain", "output_tok_s": 30.0, "wall_s": 1.0, "draft_ms_per_step": 2.0},
        {"system": "plain", "output_tok_s": 20.0, "wall_s": 2.0, "draft_ms_per_step": 1.0},
    ]
    for run in runs:
        run.update(tpot_p50_ms=run["wall_s"], verify_ms_per_step=None)
    row = spec_decode.median_row(runs)
    assert (row["output_tok_s"], row["wall_s"], row["tpot_p50_ms"]) == (20.0, 2.0, 2.0)
    assert row["draft_ms_per_step"] is None and row["system"] == "plain"
    with pytest.raises(ValueError, match="no runs"):
        spec_decode.median_row([])


def test_zero_rounds_raise(tmp_path, smollm2_tokenizer):
    checkpoint = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]
    argv = ["--rounds", "0", "--output", str(tmp_path / "x.json"), "--no-warmup"]
    with pytest.raises(ValueError, match="rounds"):
        spec_decode.main(argv, checkpoint=checkpoint)
