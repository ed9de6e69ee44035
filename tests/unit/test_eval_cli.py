"""``sparsekv eval`` end to end on a tiny random Llama with the SmolLM2 tokenizer."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from sparsekv.evaluation import main as eval_main
from sparsekv.evaluation import runner
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The command runs with ``--threads 1``; give the session its thread count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    return tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=3)[0]


def _argv(tmp_path, *extra) -> list[str]:
    argv = ["--lengths", "256", "--methods", "none,snapkv,streaming_llm", "--ratios", "0.5"]
    argv += ["--kv-window", "8", "--kv-full-layers", "1", "--dtype", "float32", "--threads", "1"]
    argv += ["--answer-margin", "4", "--kv-cache-memory", "0.05", "--no-progress"]
    argv += ["--output-dir", str(tmp_path), *extra]
    return argv


def test_eval_writes_tables_plots_and_heatmaps(tmp_path, tiny):
    argv = _argv(tmp_path, "--tasks", "passkey,niah_single,vt", "--samples", "2")
    assert eval_main.main(argv, checkpoint=tiny) == 0
    summary = json.loads((tmp_path / "eval.json").read_text())
    rows = {(r["task"], r["method"], r["ratio"]): r for r in summary["rows"]}
    cells = [("none", 0.0), ("snapkv", 0.5), ("streaming_llm", 0.5)]
    assert set(rows) == {(t, m, r) for t in ("passkey", "niah_single", "vt") for m, r in cells}
    for (_, method, _), row in rows.items():
        assert row["length"] == 256 and row["num_samples"] == 2
        assert 0.0 <= row["score"] <= 100.0
        if method == "none":
            assert row["compression_ratio"] < 0.05  # only the never-cached last token
        else:
            assert row["compression_ratio"] > 0.2
    assert summary["provenance"]["config"]["bench"]["grid"]["samples"] == 2
    with open(tmp_path / "eval_samples.csv") as f:
        samples = list(csv.DictReader(f))
    assert len(samples) == 3 * 2 * 3
    depths = {r["depth"] for r in samples if r["task"] == "passkey"}
    assert depths == {"0.25", "0.75"}  # bin centres of 2 samples
    assert {r["depth"] for r in samples if r["task"] == "vt"} == {""}
    for name in ("eval.csv", "eval.md", "eval_samples.json"):
        assert (tmp_path / name).exists()
    for task in ("passkey", "niah_single", "vt"):
        assert (tmp_path / f"eval_{task}.png").exists()
    for cell in ("none_r0", "snapkv_r0.5", "streaming_llm_r0.5"):
        assert (tmp_path / f"eval_heatmap_{cell}.png").exists()
    assert "eval_heatmap_snapkv_r0.5.png" in (tmp_path / "eval.md").read_text()


def test_needle_grid_over_given_depths(tmp_path, tiny):
    argv = _argv(tmp_path, "--tasks", "passkey", "--samples", "1", "--depths", "0.1,0.9")
    argv[argv.index("none,snapkv,streaming_llm")] = "none"
    assert eval_main.main(["--", *argv], checkpoint=tiny) == 0  # `sparsekv eval -- FLAGS`
    samples = json.loads((tmp_path / "eval_samples.json").read_text())["rows"]
    assert sorted(r["depth"] for r in samples) == [0.1, 0.9]
    assert all(0.0 <= r["score"] <= 100.0 for r in samples)


def test_quick_preset_and_plot_points():
    args = eval_main.build_parser().parse_args(["--quick"])
    assert eval_main.resolve_grid(args) == {
        "tasks": ["passkey", "niah_single"],
        "lengths": [1024],
        "samples": 2,
        "methods": ["none", "snapkv"],
        "ratios": [0.75],
        "depths": None,
    }
    summary = [
        {"task": "t", "length": 8, "method": "none", "ratio": 0.0, "score": 90.0},
        {"task": "t", "length": 8, "method": "snapkv", "ratio": 0.5, "score": 70.0},
        {"task": "t", "length": 8, "method": "snapkv", "ratio": 0.9, "score": 10.0},
    ]
    points = eval_main.plot_rows(summary, "t")
    assert sorted((p["ratio"], p["score"]) for p in points) == [
        (0.0, 90.0),
        (0.5, 70.0),
        (0.9, 10.0),
    ]
    assert {p["series"] for p in points} == {"snapkv"}


def test_cells_and_sample_plan():
    from sparsekv.config import CompressionConfig

    cells = runner.build_cells(["none", "snapkv"], [0.5, 0.9], CompressionConfig(window=8))
    assert [(c.method, c.ratio) for c in cells] == [("none", 0.0), ("snapkv", 0.5), ("snapkv", 0.9)]
    assert cells[1].policy.window == 8 and cells[1].policy.budget is None
    with pytest.raises(ValueError):
        runner.build_cells(["snapkv"], [1.0], CompressionConfig())
    assert runner.default_depths(4) == [0.125, 0.375, 0.625, 0.875]
    with pytest.raises(ValueError, match="unknown"):
        runner.build_cases(None, ["nope"], [256], 1)
