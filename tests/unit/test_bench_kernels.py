"""``sparsekv bench kernels``: the fused window-score row (``window_scores_fused_paged`` over
stacked layers) on tiny shapes with a fixed machine probe, its bound, and its clean skip where
the AMX kernel does not run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparsekv.attention.cpu import chunk_paged, ops
from sparsekv.attention.cpu import window_fused as wf
from sparsekv.bench import kernels
from sparsekv.bench.kernels import packed
from sparsekv.models.quant import ops as quant_ops
from sparsekv.models.quant.formats import PackedTensor

# bf16 matmul slow enough that the tiny row below is FLOP-bound (bandwidth bound 3.7 us).
MACHINE = {"read_bandwidth": 1e10, "matmul_flops": {"fp32": 1e11, "bf16": 1e11}}
TINY = ["--batch", "1", "--tokens", "40", "--layers", "1", "--dtypes", "bf16", "--no-reference"]
TINY += ["--prefill-tokens", "0", "--fused-layers", "2", "--fused-slots", "48", "--repeats", "2"]
TINY += ["--chunk-rows", "0", "--packed-rows", ""]  # the tests below that want them set them
FUSED_NAME = "window fused 2 layers 9h x32 rows x48 slots bf16"

amx = pytest.mark.kernel_variant("window_fused")  # a fused window kernel


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_fused_bound_is_the_larger_and_says_which():
    # SmolLM2 compaction: 28 layers x 3 KV heads x 1040 slots of bf16 keys (64 wide); Q K^T of
    # 28 x 9 query heads x 32 window rows.
    args = kernels.build_parser().parse_args([])
    key_bytes, flops = 28 * 3 * 1040 * 64 * 2, 2 * 28 * 9 * 32 * 1040 * 64
    assert (key_bytes, flops) == (11_182_080, 1_073_479_680)
    quick_memory = {"read_bandwidth": 2e10, "matmul_flops": {"bf16": 1.2e12}}
    bound, kind, note = kernels.fused_bound(args, quick_memory)
    assert kind == "FLOP" and bound == pytest.approx(flops / 1.2e12)
    assert note == "FLOP: 1.07 GFLOP at 1200 GFLOP/s > 11.2 MB of keys"
    slow_memory = {"read_bandwidth": 1e9, "matmul_flops": {"bf16": 1.2e12}}
    bound, kind, note = kernels.fused_bound(args, slow_memory)
    assert kind == "bandwidth" and bound == pytest.approx(key_bytes / 1e9)
    assert note == "bandwidth: 11.2 MB of keys > 1.07 GFLOP"


@amx
def test_fused_row_in_a_tiny_run(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    report = kernels.run(kernels.build_parser().parse_args(TINY + ["--output", str(out)]), MACHINE)
    assert json.loads(out.read_text()) == report
    rows = {row["name"]: row for row in report["results"]}
    assert {"decode native 1x40 x1 layers bf16", FUSED_NAME} <= set(rows)
    fused = rows[FUSED_NAME]
    flops = 2 * 2 * 9 * 32 * 48 * 64  # above 2 x 3 x 48 x 64 x 2 key bytes at 1e10 B/s
    assert fused["bound_kind"] == "FLOP"
    assert fused["bound_ms"] == pytest.approx(flops / 1e11 * 1e3)
    assert math.isfinite(fused["ms"]) and 0 < fused["ms"] < 1e3
    assert 0 < fused["cpu_ms_per_thread"] and math.isfinite(fused["cpu_ms_per_thread"])
    assert fused["ratio"] == pytest.approx(fused["ms"] / fused["bound_ms"])
    assert FUSED_NAME in out.with_suffix(".md").read_text()
    assert f"{FUSED_NAME:<46}" in capsys.readouterr().out


def test_fused_row_skipped_in_a_run_where_unsupported(tmp_path, capsys, monkeypatch):
    def never(*args):
        raise AssertionError("the fused kernel was called where unsupported")

    monkeypatch.setattr(wf, "supports_window_fused", lambda queries, pool: False)
    monkeypatch.setattr(wf, "window_scores_fused_paged", never)
    out = tmp_path / "kernels.json"
    report = kernels.run(kernels.build_parser().parse_args(TINY + ["--output", str(out)]), MACHINE)
    assert all(not row["name"].startswith("window fused") for row in report["results"])
    assert len(report["results"]) == (2 if ops.available_isas() else 0)  # decode + window native
    printed = capsys.readouterr().out
    assert f"{FUSED_NAME:<46} skipped: the fused window kernel does not run here" in printed
    assert "window fused" not in out.with_suffix(".md").read_text()


@pytest.mark.parametrize(
    "env, argv, reason",
    [
        ("avx512", [], "the fused window kernel does not run here"),
        (
            "",
            ["--isa", "avx2_w16"],
            "--isa avx2_w16 (the kernel runs on avx512_amx or avx512_bf16 or avx2 or generic only)",
        ),
    ],
)
def test_fused_row_skipped_for_another_variant(env, argv, reason, capsys, monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV, env)  # a forced variant without it turns the kernel off
    args = kernels.build_parser().parse_args(TINY + argv)
    assert kernels.bench_window_fused(args, MACHINE) == []
    assert f"{FUSED_NAME:<46} skipped: {reason}" in capsys.readouterr().out


@amx
def test_fused_row_runs_the_isa_it_names(capsys, monkeypatch):
    from sparsekv.attention.cpu import window_fused

    monkeypatch.delenv(ops.ISA_ENV, raising=False)
    ran = []
    real = window_fused.window_scores_fused_paged
    monkeypatch.setattr(
        window_fused, "window_scores_fused_paged", lambda *a: ran.append(a[-1]) or real(*a)
    )
    args = kernels.build_parser().parse_args(TINY + ["--isa", "generic"])
    assert len(kernels.bench_window_fused(args, MACHINE)) == 1
    assert set(ran) == {"generic"}
    capsys.readouterr()


def test_fused_slots_below_the_window_raise():
    args = kernels.build_parser().parse_args(TINY + ["--fused-slots", "16"])
    with pytest.raises(ValueError, match="--fused-slots 16 < --window 32"):
        kernels.bench_window_fused(args, MACHINE)


@pytest.mark.kernel_variant("prefill")
def test_list_prints_cpu_features_and_the_variant_of_each_family(capsys, monkeypatch):
    from sparsekv.attention.cpu import ops, prefill_ops, variants

    monkeypatch.delenv(ops.ISA_ENV, raising=False)
    assert kernels.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "CPU features: " + " ".join(variants.cpu_features())
    assert "avx2" in lines[0].split()  # every CI machine class has AVX2
    prefill = next(line for line in lines if line.startswith("prefill "))
    runnable = prefill_ops.prefill_isas()
    assert prefill == f"prefill      {runnable[0]} (the fastest this CPU runs); runs " + ", ".join(
        runnable
    )
    for variant in set(prefill_ops.PREFILL_VARIANTS) - set(runnable):
        assert f"               not {variant}: {prefill_ops.prefill_isa_status(variant)}" in lines
    monkeypatch.setenv(ops.ISA_ENV, "avx2_w16")
    status = variants.family_status("prefill")
    assert status.chosen is None
    assert status.reason == f"{ops.ISA_ENV}=avx2_w16 names none of its variants: PyTorch fallback"
    assert variants.family_status("decode").chosen == "avx2_w16"
    with pytest.raises(ValueError, match="family must be one of"):
        variants.family_status("gemm")


@pytest.mark.kernel_variant("packed_weights")
def test_list_names_the_packed_weight_variant(capsys, monkeypatch):
    from sparsekv.models.quant import ops as quant_ops

    monkeypatch.delenv(quant_ops.ISA_ENV, raising=False)
    runs = quant_ops.available_isas()
    assert kernels.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"packed       {runs[0]} (the fastest this CPU runs; runs {', '.join(runs)})" in lines
    assert ("avx512_bf16" in runs) != any("not avx512_bf16" in line for line in lines)
    assert ("avx512_amx" in runs) != any("not avx512_amx: needs" in line for line in lines)
    monkeypatch.setenv(quant_ops.ISA_ENV, "avx2")
    assert kernels.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"packed       avx2 ({quant_ops.ISA_ENV}=avx2; runs {', '.join(runs)})" in lines


@pytest.mark.kernel_variant("chunk_paged")
def test_chunk_and_packed_rows_per_variant(tmp_path):
    # one request's 3-row chunk over 40 held slots; SmolLM2's packed linears at 1 and 2 rows
    argv = TINY + ["--fused-layers", "0", "--chunk-rows", "3", "--packed-rows", "1,2"]
    report = kernels.run(
        kernels.build_parser().parse_args(argv + ["--output", str(tmp_path / "k.json")]), MACHINE
    )
    rows = {row["name"]: row for row in report["results"]}
    for isa in chunk_paged.chunk_isas():
        chunk = rows[f"chunk {isa} 1x3 rows x40 bf16"]
        # 2 x 3 KV heads x 40 slots x 64 x 2 bytes at 1e10 B/s vs 4 x 9 x 3 x 40 x 64 FLOP at 1e11
        assert chunk["bound_ms"] == pytest.approx(max(30720 / 1e10, 276480 / 1e11) * 1e3)
        assert math.isfinite(chunk["ms"]) and chunk["ms"] > 0
    packed_isas = quant_ops.available_isas()
    names = [name for name in rows if name.startswith("packed ")]
    x16 = [isa for isa in packed_isas if isa in quant_ops.X16_VARIANTS]  # x16 layout runs too
    assert len(names) == len(packed.SHAPES) * 2 * (len(packed_isas) + len(x16))
    head = rows[f"packed lm_head q8_0 49152x576 m=2 {packed_isas[0]}"]
    assert head["bound_ms"] == pytest.approx(49152 * 18 * 34 / 1e10 * 1e3)
    for isa in x16:
        x16_head = rows[f"packed lm_head q8_0x16 49152x576 m=2 {isa}"]
        assert x16_head["bound_ms"] == head["bound_ms"] and x16_head["ms"] > 0


@pytest.mark.parametrize("counts", ["1,0", "1,x", "-2"])
def test_bad_packed_rows_fail_before_any_row_runs(counts, capsys):
    args = kernels.build_parser().parse_args(TINY + ["--packed-rows", counts])
    with pytest.raises(ValueError, match="--packed-rows: every count must be an integer >= 1"):
        kernels.run(args, MACHINE)
    assert "ms (cpu/thread" not in capsys.readouterr().out
    assert packed.packed_counts("") == [] and packed.packed_counts("1,16") == [1, 16]


def test_negative_chunk_rows_fail(capsys):
    args = kernels.build_parser().parse_args(TINY + ["--chunk-rows", "-1"])
    with pytest.raises(ValueError, match="--chunk-rows: must be >= 0"):
        kernels.run(args, MACHINE)
    assert "ms (cpu/thread" not in capsys.readouterr().out


def test_random_packed_weights_dequantize_to_their_scale():
    weight = packed.random_packed("q4_1", 4, 64)
    dense = quant_ops.dequantize(PackedTensor("q4_1", 64, weight))
    codes = torch.stack([weight[:, 4:20] & 15, weight[:, 4:20] >> 4], -1)  # first block's bytes
    expected = 0.01 * torch.cat([codes[..., 0], codes[..., 1]], 1).float() + 0.01
    torch.testing.assert_close(dense[:, :32], expected, rtol=1e-3, atol=1e-5)
