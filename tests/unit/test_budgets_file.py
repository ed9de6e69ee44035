"""Calibrated per-layer budgets: the budgets file round-trips and is validated, the allocation
spends exactly the flat policy's total, and the flag and config turn fractions into budgets."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.cli import build_parser
from sparsekv.cli_args import engine_config_from_args
from sparsekv.compression.budgets_file import LayerBudgets, load_budgets, save_budgets
from sparsekv.config import CompressionConfig
from sparsekv.evaluation.calibrate import ConcentrationProbe, allocate, top_mass
from sparsekv.kv_cache.budget import layer_budgets


@pytest.mark.parametrize(
    "budgets",
    [
        LayerBudgets("fractions", (1.0, 0.5, 0.125), {"model": "m", "calibration": {"rows": 8}}),
        LayerBudgets("tokens", (0, 64, 128)),
    ],
)
def test_round_trip(tmp_path, budgets):
    path = tmp_path / "budgets.json"
    save_budgets(path, budgets)
    assert load_budgets(path, num_layers=3) == budgets
    assert json.loads(path.read_text())["num_layers"] == 3


@pytest.mark.parametrize(
    "change,message",
    [
        ({"budgets": [1.0, 0.0, 0.5]}, r"budgets\[1\] = 0.0; a fraction must be in \(0, 1\]"),
        ({"budgets": [1.0, 1.5, 0.5]}, r"budgets\[1\] = 1.5"),
        ({"budgets": [1.0, "x", 0.5]}, r"budgets\[1\] = 'x'"),
        ({"kind": "tokens", "budgets": [0, -1, 8]}, r"budgets\[1\] = -1; a token budget"),
        ({"kind": "tokens", "budgets": [0, 0.5, 8]}, r"budgets\[1\] = 0.5"),
        ({"kind": "percent"}, "kind must be one of fractions, tokens"),
        ({"num_layers": 4}, "num_layers is 4 but 3 budgets"),
        ({"format": "other"}, "is not a sparsekv-layer-budgets file"),
        ({"version": 2}, "version 2 is not 1"),
        # JSON's true and 1.0 compare equal to 1: the version is an integer, not a bool.
        ({"version": True}, r"version True is not 1 \(an integer\)"),
        ({"version": 1.0}, r"version 1.0 is not 1 \(an integer\)"),
        ({"version": "1"}, "version '1' is not 1"),
        ({"budgets": [1.0], "num_layers": True}, "num_layers is True but 1 budgets"),
        ({"budgets": "1,2"}, "budgets must be a list"),
    ],
)
def test_invalid_files_name_the_field(tmp_path, change, message):
    document = LayerBudgets("fractions", (1.0, 0.5, 0.25)).to_json() | change
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="kv_layer_budgets_file: .*" + message):
        load_budgets(path)


def test_length_must_match_the_model_and_the_file_must_parse(tmp_path):
    path = tmp_path / "b.json"
    save_budgets(path, LayerBudgets("fractions", (1.0, 0.5)))
    with pytest.raises(ValueError, match="2 budgets for a model with 30 layers"):
        load_budgets(path, num_layers=30)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="kv_layer_budgets_file: cannot read"):
        load_budgets(path)


@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
def test_allocation_spends_the_flat_total(ratio):
    need = [0.9, 0.01, 0.2, 0.05, 0.3, 0.02, 0.4, 0.04]
    compressible = [True] * 7 + [False]
    fractions = allocate(need, compressible, ratio, floor=0.02)
    assert fractions[-1] == 1.0  # a sliding layer stays full and does not count
    assert sum(fractions[:7]) == pytest.approx((1 - ratio) * 7, abs=1e-9)
    assert all(0.02 <= f <= 1 for f in fractions)
    # More need, more budget (monotone), and the neediest layer is capped at full.
    order = sorted(range(7), key=lambda i: need[i])
    assert [fractions[i] for i in order] == sorted(fractions[i] for i in order)
    if ratio == 0.5:
        assert fractions[0] == 1.0


def test_allocation_rejects_bad_settings():
    with pytest.raises(ValueError, match="compression_ratio"):
        allocate([0.1], [True], 1.0)
    with pytest.raises(ValueError, match="floor"):
        allocate([0.1], [True], 0.9, floor=0.2)


def test_top_mass_counts_the_largest_slots():
    probs = torch.tensor([[[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]])
    assert top_mass(probs, 0.25) == pytest.approx((0.5 + 0.25) / 2)
    assert top_mass(probs, 0.5) == pytest.approx((0.8 + 0.5) / 2)


def test_fractions_become_layer_budgets():
    config = CompressionConfig(layer_fractions=(1.0, 0.5, 0.01, 0.25), window=8)
    assert layer_budgets(config, 4, 1000, [True, True, True, False]) == [None, 500, 10, None]
    with pytest.raises(ValueError, match="layer_fractions: 4 fractions for a model with 3"):
        layer_budgets(config, 3, 1000, [True] * 3)
    with pytest.raises(ValueError, match="layer_fractions: 0 is not in"):
        CompressionConfig(layer_fractions=(0, 1)).validate()
    with pytest.raises(ValueError, match="exclusive"):
        CompressionConfig(layer_fractions=(1.0,), layer_budgets=(0,)).validate()


def test_budgets_file_flag(tmp_path):
    path = tmp_path / "b.json"
    save_budgets(path, LayerBudgets("fractions", (1.0, 0.3)))
    args = build_parser().parse_args(["generate", "--kv-layer-budgets-file", str(path)])
    assert engine_config_from_args(args).compression.layer_fractions == (1.0, 0.3)
    save_budgets(path, LayerBudgets("tokens", (0, 64)))
    args = build_parser().parse_args(["generate", "--kv-layer-budgets-file", str(path)])
    assert engine_config_from_args(args).compression.layer_budgets == (0, 64)
    args = build_parser().parse_args(
        ["generate", "--kv-layer-budgets-file", str(path), "--kv-layer-budgets", "0,64"]
    )
    with pytest.raises(ValueError, match="kv_layer_budgets_file: exclusive"):
        engine_config_from_args(args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_attention_is_causal_attention_in_the_model_dtype(dtype):
    # The probe replaces the model's attention, so its output must come back in the model's
    # compute dtype (a bf16 model's next linear rejects fp32 input) with SDPA's values.
    torch.manual_seed(0)
    q = torch.randn(7, 4, 16, dtype=dtype)  # [tokens, heads, head_dim]
    k, v = torch.randn(7, 2, 16, dtype=dtype), torch.randn(7, 2, 16, dtype=dtype)
    probe = ConcentrationProbe(keep=0.5, rows=3)
    out = probe.attend(0, q, k, v, scale=0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(2, 1).transpose(0, 1),
        v.float().repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.25,
    ).transpose(0, 1)  # fmt: skip
    assert out.dtype == dtype and out.shape == (7, 4, 16)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6  # a bf16 step in [2, 4)
    torch.testing.assert_close(out.float(), expected.to(dtype).float(), atol=tolerance, rtol=0)
    assert 0.5 < probe.top_mass[0] <= 1.0


@pytest.mark.parametrize("ratio", ["-0.5", "nan", "1"])
def test_calibrate_checks_the_ratio_before_loading(ratio, tmp_path, monkeypatch):
    from sparsekv import cli
    from sparsekv.bench import common

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the ratio was checked")

    monkeypatch.setattr(common, "load_checkpoint", no_model)
    argv = ["calibrate", "--ratio", ratio, "--output", str(tmp_path / "c.json")]
    assert cli.main(argv) == 2
    assert not (tmp_path / "c.json").exists()


def test_calibrate_without_a_text_that_long_writes_nothing(tmp_path, smollm2_tokenizer):
    from sparsekv.evaluation import calibrate
    from tests.conftest import tiny_checkpoint, tiny_llama_config

    tiny = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=1)[0]
    argv = ["--tokens", str(10**9), "--texts", "1", "--output", str(tmp_path / "c.json")]
    argv += ["--threads", "1", "--dtype", "float32", "--kv-cache-memory", "0.05"]
    before = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match=r"^tokens: no calibration text .* 1000000000 tokens"):
            calibrate.main(argv, checkpoint=tiny)
    finally:
        torch.set_num_threads(before)
    assert not (tmp_path / "c.json").exists()
