"""W8A8 prefill matmuls on ``int8`` weights (``int8_rows.int8_rows_matmul``): x's rows quantized to
int8 with one scale each, the products exact in int32, the scaling in fp32.

Checked against a PyTorch reference of the same arithmetic on every variant with the path this
CPU runs (``avx512_amx``, ``avx512_vnni``, ``avx2``; the others are named untested), for ragged
row counts around the chunking (:data:`int8_rows.INT8_CHUNK_ROWS`); a ``QuantizedLinear`` built
with ``int8_rows`` (``--weight-dtype w8a8``) takes the path for more than its kernel rows, one
without it and any on the other variants keep the dense path. Where oneDNN's int8 GEMM saturates
(AVX2 without VNNI; emulated here in a subprocess limited to AVX2) weights have 7-bit codes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sparsekv.models.layers import GatedMLP
from sparsekv.models.quant import build, int8_rows, ops
from sparsekv.models.quant.formats import (
    PackedTensor,
    dequantize_reference,
    pack_bf16,
    quantize_int8,
)
from sparsekv.models.quant.linear import QuantizedLinear

INT8_ISAS = [
    pytest.param(v, marks=pytest.mark.kernel_variant("packed_weights", v))
    for v in int8_rows.INT8_ROWS_VARIANTS
]
# Rows of x: past the kernels' 64, one chunk, just over one chunk (two near-equal ones), and
# several; in_features with and without a vector tail.
ROWS = (65, 100, 512, 513, 1100)


def _quantize(weight: torch.Tensor):
    """``quantize_int8`` as ``--weight-dtype w8a8`` packs here: 7-bit codes where the int8 GEMM
    saturates."""
    saturates = int8_rows.int8_gemm_saturates()
    return quantize_int8(weight, int8_rows.SATURATING_GEMM_CODE_MAX if saturates else 127)


def _reference(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The int8 path's arithmetic in PyTorch, fp32 result."""
    xf = x.float()
    top = xf.abs().amax(dim=1)
    safe = torch.where(top > 0, top, torch.ones_like(top))
    codes = torch.round(xf * (torch.tensor(127.0) / safe)[:, None])
    codes = torch.where(top[:, None] > 0, codes, torch.zeros_like(codes))
    scale = torch.where(top > 0, top / 127.0, torch.zeros_like(top))
    data = weight.data
    wcodes = data[:, 4:].contiguous().view(torch.int8).double()
    wscale = data[:, :4].contiguous().view(torch.float32).reshape(-1)
    acc = (codes.double() @ wcodes.T).float()  # exact: |acc| < 2^24 at these widths
    y = acc * scale[:, None] * wscale[None, :]
    return y if bias is None else y + bias


@pytest.fixture(params=INT8_ISAS)
def int8_isa(request, monkeypatch) -> str:
    assert build.load_extension() is not None, "the packed-weight extension failed to build"
    monkeypatch.setenv(ops.ISA_ENV, request.param)
    return request.param


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features", [96, 579])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_rows_match_the_reference(int8_isa, rows, in_features, with_bias):
    g = torch.Generator().manual_seed(rows + in_features)
    weight = _quantize(torch.randn(200, in_features, generator=g))
    x = torch.randn(rows, in_features, generator=g) * torch.rand(rows, 1, generator=g) * 4
    bias = torch.randn(200, generator=g) if with_bias else None
    assert int8_rows.int8_rows_runs(x)
    y = int8_rows.int8_rows_matmul(x, weight, bias)
    expected = _reference(x, weight, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, 200)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(70, 256, 48), (600, 579, 200)])
def test_bf16_rows_round_once(int8_isa, rows, in_features, out_features):
    # 579 inputs and 200 outputs: the masked bf16 loads and stores of the vector tails; x is a
    # column slice of a wider tensor (row stride past in_features)
    g = torch.Generator().manual_seed(rows)
    weight = _quantize(torch.randn(out_features, in_features, generator=g))
    wide = torch.randn(rows, in_features + 37, generator=g).bfloat16()
    x = wide[:, :in_features]
    bias = torch.randn(out_features, generator=g)
    y = int8_rows.int8_rows_matmul(x, weight, bias)
    expected = _reference(x, weight, bias)
    assert y.dtype == torch.bfloat16
    # one rounding of a value within 1e-5 of the reference: at most one bf16 step apart
    step = expected.abs() * 2**-7
    assert ((y.float() - expected).abs() <= step + 1e-6).all()


def test_codes_are_exact(int8_isa):
    # An identity weight with unit scales returns each row's codes times its scale, so every
    # code is compared exactly (rounding to nearest even included).
    k = 64
    weight = quantize_int8(torch.eye(k) * 127.0)  # scale 1, codes 127 on the diagonal
    weight.data[:, 4:].view(torch.int8).copy_(torch.eye(k, dtype=torch.int8))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(80, k, generator=g)
    x[0, :3] = torch.tensor([127.0, 0.5, -1.5])  # ties: 0.5 -> 0, -1.5 -> -2
    x[0, 3:] = 0.0
    y = int8_rows.int8_rows_matmul(x, weight)
    assert torch.equal(y, _reference(x, weight, None))
    assert y[0, :4].tolist() == [127.0, 0.0, -2.0, 0.0]


def test_zero_and_non_finite_rows_stay_in_their_row(int8_isa):
    g = torch.Generator().manual_seed(5)
    weight = _quantize(torch.randn(32, 128, generator=g))
    bias = torch.randn(32, generator=g)
    x = torch.randn(90, 128, generator=g)
    x[4] = 0.0
    x[7, 9] = float("nan")
    x[8, 2] = float("inf")
    y = int8_rows.int8_rows_matmul(x, weight, bias)
    assert torch.equal(y[4], bias)
    assert torch.isnan(y[7]).all() and torch.isnan(y[8]).all()  # non-finite: a NaN row
    rest = [r for r in range(90) if r not in (4, 7, 8)]
    torch.testing.assert_close(y[rest], _reference(x, weight, bias)[rest], rtol=1e-5, atol=1e-4)
    yb = int8_rows.int8_rows_matmul(x.bfloat16(), weight, bias)
    assert torch.isnan(yb[7:9]).all() and not torch.isnan(yb[rest]).any()


def test_linear_takes_the_path_past_its_kernel_rows(int8_isa):
    g = torch.Generator().manual_seed(7)
    dense = torch.randn(96, 160, generator=g)
    layer = QuantizedLinear([_quantize(dense)], torch.randn(96, generator=g), int8_rows=True)
    x = torch.randn(2, 100, 160, generator=g)  # 200 rows: past the kernels' 64
    y = layer(x)
    expected = _reference(x.reshape(-1, 160), layer.parts[0], layer.bias).reshape(2, 100, 96)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    head = layer.leading_rows(32)
    assert head.int8_rows
    torch.testing.assert_close(head(x), expected[..., :32], rtol=1e-5, atol=1e-4)
    # without int8_rows (--weight-dtype int8) the same layer multiplies the dequantized weight
    plain = QuantizedLinear(layer.parts, layer.bias)
    dense_y = x @ dequantize_reference(layer.parts[0]).T + layer.bias
    torch.testing.assert_close(plain(x), dense_y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("large", [False, True], ids=["layer", "head"])
def test_decode_batches_take_the_path_where_it_is_faster(int8_isa, large, monkeypatch):
    # A layer (and an output head, a weight over LARGE_DENSE_BYTES as bf16) takes decode-sized
    # row counts through the int8 path from DECODE_MIN_ROWS(_LARGE) on its variant; fewer rows
    # and other variants keep the kernels, whose result is x times the dequantized weight.
    g = torch.Generator().manual_seed(11)
    out_features = 8192 + 16 if large else 96
    dense = torch.randn(out_features, 1024 if large else 160, generator=g)
    layer = QuantizedLinear([_quantize(dense)], int8_rows=True)
    assert layer.large_weight == large
    table = int8_rows.DECODE_MIN_ROWS_LARGE if large else int8_rows.DECODE_MIN_ROWS
    least = table.get(int8_isa)
    calls = []
    original = int8_rows.int8_rows_matmul
    monkeypatch.setattr(
        int8_rows, "int8_rows_matmul", lambda x, *a: calls.append(x.shape[0]) or original(x, *a)
    )
    for rows in (1, 2, 5, 6, 8, 16):
        x = torch.randn(rows, layer.in_features, generator=g)
        calls.clear()
        y = layer(x)
        if least is not None and rows >= least:
            assert calls == [rows]
            torch.testing.assert_close(y, _reference(x, layer.parts[0], None), rtol=1e-5, atol=1e-4)
        else:
            assert calls == []
            dense_y = x @ dequantize_reference(layer.parts[0]).T
            torch.testing.assert_close(y, dense_y, rtol=1e-5, atol=1e-4)
    assert int8_rows.DECODE_MIN_ROWS == {"avx512_vnni": 2, "avx2": 2}


def test_int8_rows_needs_one_int8_part():
    with pytest.raises(ValueError, match="int8_rows: needs one int8 part"):
        QuantizedLinear([pack_bf16(torch.randn(16, 32))], int8_rows=True)


@pytest.mark.parametrize("isa", ["avx512_bf16", "generic"])
def test_variants_without_the_path_stay_dense(isa, monkeypatch):
    if isa not in ops.available_isas():
        isa = "generic"  # always runs: the case still checks the dense path
    monkeypatch.setenv(ops.ISA_ENV, isa)
    g = torch.Generator().manual_seed(9)
    weight = _quantize(torch.randn(40, 128, generator=g))
    layer = QuantizedLinear([weight], int8_rows=True)
    x = torch.randn(100, 128, generator=g)
    assert not int8_rows.int8_rows_runs(x)
    expected = x @ dequantize_reference(weight).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # (with the native kernels disabled there is no op at all)
    with pytest.raises(RuntimeError, match="int8 GEMM passes|needs the native packed-weight"):
        int8_rows.int8_rows_matmul(x, weight)


def test_bad_arguments_raise(int8_isa):
    weight = _quantize(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="x must be a CPU float32 or bfloat16"):
        int8_rows.int8_rows_matmul(torch.randn(70, 32), weight)
    with pytest.raises(RuntimeError, match="x must be a CPU float32 or bfloat16"):
        int8_rows.int8_rows_matmul(torch.randn(70, 64).half(), weight)
    with pytest.raises(RuntimeError, match=r"in_features must be in \[1, 133143\]"):
        int8_rows.int8_rows_matmul(torch.randn(70, 133144), _quantize(torch.randn(2, 133144)))
    # a column-strided x is made contiguous first
    x = torch.randn(64, 70).T
    torch.testing.assert_close(
        int8_rows.int8_rows_matmul(x, weight), int8_rows.int8_rows_matmul(x.contiguous(), weight)
    )
    assert not int8_rows.int8_rows_runs(torch.randn(70, 64).half())


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def _gated_reference(x, weight, bias, activation):
    y = _reference(x, weight, bias)
    half = y.shape[1] // 2
    return ACTIVATIONS[activation](y[:, :half]) * y[:, half:]


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_rows_match_the_reference(int8_isa, activation, with_bias):
    # 600 rows (two chunks), 579 inputs, 2 x 200 outputs (vector tails)
    g = torch.Generator().manual_seed(11)
    weight = _quantize(torch.randn(400, 579, generator=g))
    x = torch.randn(600, 579, generator=g) * torch.rand(600, 1, generator=g) * 0.3
    bias = torch.randn(400, generator=g) if with_bias else None
    y = int8_rows.int8_rows_matmul(x, weight, bias, activation)
    expected = _gated_reference(x, weight, bias, activation)
    assert y.shape == (600, 200) and y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    yb = int8_rows.int8_rows_matmul(x.bfloat16(), weight, bias, activation)
    expected_b = _gated_reference(x.bfloat16(), weight, bias, activation)
    assert yb.dtype == torch.bfloat16
    assert ((yb.float() - expected_b).abs() <= expected_b.abs() * 2**-7 + 1e-5).all()


def test_gated_mlp_applies_the_activation_in_the_int8_path(int8_isa, monkeypatch):
    g = torch.Generator().manual_seed(13)
    mlp = GatedMLP(128, 96, "silu")
    with torch.no_grad():
        mlp.gate_up_proj = QuantizedLinear(
            [_quantize(torch.randn(192, 128, generator=g))], int8_rows=True
        )
        mlp.down_proj = QuantizedLinear(
            [_quantize(torch.randn(128, 96, generator=g))], int8_rows=True
        )
    x = torch.randn(150, 128, generator=g)
    fused = mlp(x)
    hidden = int8_rows.int8_rows_matmul(x, mlp.gate_up_proj.parts[0], None, "silu")
    assert torch.equal(fused, mlp.down_proj(hidden))
    unfused = mlp.down_proj(F.silu(mlp.gate_up_proj(x)[:, :96]) * mlp.gate_up_proj(x)[:, 96:])
    torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-3 * unfused.abs().max().item())
    # one row (a lone decode row), no int8_rows, an activation it does not fuse: the caller's
    # path; a decode batch takes the fused path where the variant sends it to int8
    assert mlp.gate_up_proj.gated_forward(x[:1], "silu") is None
    batch = mlp.gate_up_proj.gated_forward(x[:8], "silu")
    assert (batch is not None) == (int8_rows.DECODE_MIN_ROWS.get(int8_isa, 99) <= 8)
    if batch is not None:
        torch.testing.assert_close(batch, hidden[:8])
    assert mlp.gate_up_proj.gated_forward(x, "relu") is None
    plain = QuantizedLinear(mlp.gate_up_proj.parts)
    assert plain.gated_forward(x, "silu") is None


def test_gated_arguments_raise(int8_isa):
    x = torch.randn(70, 64)
    with pytest.raises(RuntimeError, match="activation must be '', 'silu' or 'gelu_tanh'"):
        int8_rows.int8_rows_matmul(x, _quantize(torch.randn(8, 64)), None, "relu")
    with pytest.raises(RuntimeError, match="needs an even number of output features"):
        int8_rows.int8_rows_matmul(x, _quantize(torch.randn(7, 64)), None, "silu")
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous CPU float32 \[8\]"):
        int8_rows.int8_rows_matmul(x, _quantize(torch.randn(8, 64)), torch.zeros(4), "silu")


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gated_extremes(int8_isa, activation):
    # identity gate and up halves with unit scales: gate = up = each row's dequantized codes,
    # rows reaching far past the exponential's clamps (|gate| up to 1e30; the products
    # overflow to inf where fp32 does)
    k = 32
    weight = quantize_int8(torch.eye(k).repeat(2, 1) * 127.0)
    weight.data[:, 4:].view(torch.int8).copy_(torch.eye(k, dtype=torch.int8).repeat(2, 1))
    x = torch.zeros(70, k)
    x[:, 0] = torch.logspace(-3, 30, 70)
    x[:, 1] = -x[:, 0]
    x[:, 2] = torch.linspace(-120, 120, 70)
    y = int8_rows.int8_rows_matmul(x, weight, None, activation)
    expected = _gated_reference(x, weight, None, activation)
    assert torch.isinf(expected).any() and not torch.isnan(y).any()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_gated_mlp_gelu_bf16_and_hooks_fall_back(int8_isa):
    g = torch.Generator().manual_seed(17)
    mlp = GatedMLP(64, 48, "gelu_tanh")
    mlp.gate_up_proj = QuantizedLinear(
        [_quantize(torch.randn(96, 64, generator=g))], int8_rows=True
    )
    mlp.down_proj = QuantizedLinear([_quantize(torch.randn(64, 48, generator=g))])
    x = torch.randn(100, 64, generator=g).bfloat16()
    hidden = int8_rows.int8_rows_matmul(x, mlp.gate_up_proj.parts[0], None, "gelu_tanh")
    assert torch.equal(mlp(x), mlp.down_proj(hidden))
    # a forward hook on gate / up must run: the MLP then takes the unfused path
    mlp.gate_up_proj.register_forward_hook(lambda module, inputs, output: output * 0)
    assert mlp.gate_up_proj.gated_forward(x, "gelu_tanh") is None
    assert torch.equal(mlp(x), mlp.down_proj(torch.zeros(100, 48, dtype=torch.bfloat16)))


# A process whose oneDNN is limited to AVX2 (an AVX2-only CPU's int8 GEMM, which sums u8 x s8
# pairs in saturating int16): full-range codes come out wrong there, 7-bit ones exact; w8a8
# packing picks 7 bits; the avx2 passes around the GEMM give the reference's values.
AVX2_GEMM = """
import logging, sys, torch
from torch import nn
logging.basicConfig(level=logging.INFO)
from sparsekv.models.quant import int8_rows, ops
from sparsekv.models.quant.apply import apply_weight_dtype
from sparsekv.models.quant.formats import quantize_int8
from sparsekv.models.quant.linear import QuantizedLinear
torch.set_num_threads(1)
assert int8_rows.int8_gemm_saturates()
full = torch.full((32, 64), 127, dtype=torch.int8)
assert torch._int_mm(full, full.T.contiguous())[0, 0] != 127 * 127 * 64
model = nn.Module()
model.proj = nn.Linear(200, 96, bias=False)
model.lm_head = nn.Linear(200, 64, bias=False)
assert apply_weight_dtype(model, "w8a8") == 2
def top(layer):
    return int(layer.parts[0].data[:, 4:].contiguous().view(torch.int8).abs().max())
# the layer that feeds the int8 GEMM gets 7 bits, the output head (no int8 path) keeps 8
assert top(model.proj) == int8_rows.SATURATING_GEMM_CODE_MAX and top(model.lm_head) == 127
try:
    QuantizedLinear([quantize_int8(torch.randn(96, 200))], int8_rows=True)
    raise SystemExit("8-bit codes accepted on a saturating GEMM")
except ValueError as e:
    assert "code_max=63" in str(e)
g = torch.Generator().manual_seed(1)
weight = quantize_int8(torch.randn(96, 200, generator=g), int8_rows.SATURATING_GEMM_CODE_MAX)
x = torch.randn(130, 200, generator=g)
x[:2] = 1.0  # codes 127 against every weight code: an unsigned-side saturation would show
assert int8_rows.int8_rows_runs(x) and ops.resolved_kernels()[1] == "avx2"
torch.save({"weight": weight.data, "x": x, "y": int8_rows.int8_rows_matmul(x, weight),
            "y_silu": int8_rows.int8_rows_matmul(x, weight, None, "silu")}, sys.argv[1])
"""


@pytest.mark.kernel_variant("packed_weights", "avx2")
def test_saturating_int8_gemm_gets_seven_bit_weights(tmp_path):
    assert build.load_extension() is not None, "the packed-weight extension failed to build"
    out = tmp_path / "avx2.pt"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", **{ops.ISA_ENV: "avx2"})
    done = subprocess.run(
        [sys.executable, "-c", AVX2_GEMM, str(out)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "packed (7-bit codes: this CPU's int8 GEMM saturates)" in done.stderr
    got = torch.load(out)
    weight = PackedTensor("int8", 200, got["weight"])
    expected = _reference(got["x"], weight, None)
    torch.testing.assert_close(
        got["y"], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item()
    )
    half = expected.shape[1] // 2
    gated = F.silu(expected[:, :half]) * expected[:, half:]
    torch.testing.assert_close(
        got["y_silu"], gated, rtol=1e-5, atol=1e-5 * gated.abs().max().item()
    )


def test_seven_bit_codes_round_within_half_a_step():
    g = torch.Generator().manual_seed(19)
    w = torch.randn(24, 100, generator=g)
    w[3] = 0.0
    packed = quantize_int8(w, int8_rows.SATURATING_GEMM_CODE_MAX)
    codes = packed.data[:, 4:].contiguous().view(torch.int8)
    scales = packed.data[:, :4].contiguous().view(torch.float32).reshape(-1)
    assert codes.abs().max() == 63 and (codes.abs().amax(dim=1)[[0, 5]] == 63).all()
    assert scales[3] == 1.0 and not codes[3].any()
    torch.testing.assert_close(scales[0], w[0].abs().max() / 63)
    err = (codes.float() * scales[:, None] - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-7).all()
    for bad in (0, 128, -5):
        with pytest.raises(ValueError, match="code_max must be in"):
            quantize_int8(w, bad)


def test_narrow_layers_keep_the_dense_path(int8_isa):
    # fewer outputs than INT8_ROWS_MIN_OUTPUTS (oneDNN may swap the operands of such a GEMM)
    g = torch.Generator().manual_seed(23)
    weight = _quantize(torch.randn(int8_rows.INT8_ROWS_MIN_OUTPUTS - 1, 64, generator=g))
    layer = QuantizedLinear([weight], int8_rows=True)
    x = torch.randn(100, 64, generator=g)
    assert not layer._takes_int8_rows(x)
    torch.testing.assert_close(layer(x), x @ dequantize_reference(weight).T, rtol=1e-5, atol=1e-5)


def test_kernel_list_names_the_int8_rows_path(monkeypatch):
    from sparsekv.bench.kernels import variants as kernel_list

    assert build.load_extension() is not None, "the packed-weight extension failed to build"
    lines = [line for line in kernel_list.variant_lines() if line.startswith("int8_rows")]
    in_use = ops.resolved_kernels()[1]
    assert len(lines) == 1 and f" {in_use} " in lines[0]
    exact = not int8_rows.int8_gemm_saturates()
    assert ("exact on full-range codes" in lines[0]) == exact
    monkeypatch.setattr(int8_rows, "int8_gemm_saturates", lambda: True)
    assert kernel_list._int8_rows_line("avx2").endswith("w8a8 weights get 7-bit codes")
    assert kernel_list._int8_rows_line("generic").startswith(
        "int8_rows    none on generic (w8a8 prefill runs as int8"
    )
