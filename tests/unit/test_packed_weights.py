"""Packed-weight kernels (``sparsekv.models.quant``) against the dequantized reference.

Every format (the GGUF blocks Q4_0 / Q4_1 / Q8_0 / Q5_0 and super-blocks Q4_K / Q6_K, int8 per
channel, bf16 rows), every row count
1-64 (the GEMV at one row, the tiled GEMM above), odd output widths and row formats of odd
width, on each kernel variant this CPU runs, both called directly and forced through
``SPARSEKV_KERNEL_ISA``. The dequantized values equal ``gguf.quants.dequantize`` bit for bit;
products accumulate in fp32 in the kernel's own order, so each output is within
``1e-5 * sum_j |x_j W_ij|`` of the exact (fp64) product of the dequantized weight (measured:
below 2e-7 of that sum). bf16 activations (the ``avx512_bf16`` variant's kernels for Q4_0 /
Q4_1 / Q8_0, an fp32 conversion inside the op elsewhere) meet the same bound against the fp64
product of ``x.float()``, and bf16 results are that fp32 result (bias added) rounded once.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from sparsekv.models.quant import build, ops
from sparsekv.models.quant.formats import (
    FORMATS,
    PackedTensor,
    cat_rows,
    dequantize_reference,
    pack_bf16,
    quantize_int8,
    unpack_x16_reference,
)
from sparsekv.models.quant.linear import QuantizedLinear
from tests.kernel_variants import PACKED_VARIANTS

VARIANTS = PACKED_VARIANTS
BLOCK_FORMATS = {
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q8_0": "Q8_0",
    "q5_0": "Q5_0",
    "q4_k": "Q4_K",
    "q6_k": "Q6_K",
}
# Byte offsets of each block's fp16 scale, and of its offset / min where it has one.
SCALE_AT = {"q4_0": 0, "q4_1": 0, "q8_0": 0, "q5_0": 0, "q4_k": 0, "q6_k": 208}
OFFSET_AT = {"q4_1": 2, "q4_k": 2}
ALL_FORMATS = (*BLOCK_FORMATS, "int8", "bf16")
# |y - exact| <= RTOL * sum_j |x_j W_ij| (fp32 accumulation over in_features).
RTOL = 1e-5
# Formats with bf16-x kernels (avx512_bf16) and int8-x kernels and x16 layouts (avx512_vnni).
BF16_FORMATS = ("q4_0", "q4_1", "q8_0")
# Cases of the avx512_vnni variant's int8-activation and x16 kernels alone.
X16 = pytest.mark.kernel_variant("packed_weights", "avx512_vnni")
# The variants that quantize bf16 x to int8 for Q4_0 / Q4_1 / Q8_0 in the file's layout
# (avx512_amx runs avx512_vnni's kernels there; its own tiles serve the x16 layouts only).
INT8_X_ISAS = ("avx512_amx", "avx512_vnni")
# The variants with x16 kernels (ops.X16_VARIANTS), one case each where the CPU runs it.
X16_ISAS = pytest.mark.parametrize(
    "x16_isa",
    [
        pytest.param(v, marks=pytest.mark.kernel_variant("packed_weights", v))
        for v in ops.X16_VARIANTS
    ],
)


def _ext():
    ext = build.load_extension()
    assert ext is not None, "the packed-weight extension failed to build"
    return ext


@pytest.fixture(
    params=[
        pytest.param(v, marks=pytest.mark.kernel_variant("packed_weights", v)) for v in VARIANTS
    ]
)
def isa(request) -> str:
    return request.param


def random_weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> PackedTensor:
    """Random packed weight: every code value, finite fp16 scales (and Q4_1 offsets)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        return quantize_int8(torch.randn(out_features, in_features, generator=g))
    if fmt == "bf16":
        return pack_bf16(torch.randn(out_features, in_features, generator=g))
    layout = FORMATS[fmt]
    blocks = in_features // layout.block_values
    data = torch.randint(
        0, 256, (out_features, blocks, layout.block_bytes), dtype=torch.uint8, generator=g
    )
    scales = (torch.rand(out_features, blocks, 1, generator=g) * 0.02 + 1e-4).half()
    data[..., SCALE_AT[fmt] : SCALE_AT[fmt] + 2] = scales.view(torch.uint8)
    if fmt in OFFSET_AT:
        offsets = (torch.randn(out_features, blocks, 1, generator=g) * 0.05).half()
        data[..., OFFSET_AT[fmt] : OFFSET_AT[fmt] + 2] = offsets.view(torch.uint8)
    return PackedTensor(fmt, in_features, data.reshape(out_features, -1).contiguous())


def width(fmt: str, base: int) -> int:
    """An in_features for ``fmt`` near ``base`` blocks of 32: ``base`` scaled to the format's
    block (super-blocks of 256: 8x), or ``base + 3`` for the row formats (a vector tail)."""
    if fmt in ("int8", "bf16"):
        return base + 3
    return base * FORMATS[fmt].block_values // 32


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``y`` (fp32) within RTOL of the fp64 product, relative to the sum of |terms|."""
    exact = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    error = (y.double() - exact).abs()
    assert y.dtype == torch.float32
    assert (error <= RTOL * scale + 1e-30).all(), f"max rel {(error / scale).max().item():.2e}"


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_reference_dequantization_equals_gguf(fmt):
    weight = random_weight(fmt, 7, width(fmt, 96))
    qtype = getattr(gguf.GGMLQuantizationType, BLOCK_FORMATS[fmt])
    expected = torch.from_numpy(gguf_dequantize(weight.data.numpy(), qtype).copy())
    assert torch.equal(dequantize_reference(weight), expected)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_native_dequantization_is_exact(isa, fmt):
    weight = random_weight(fmt, 13, width(fmt, 160) if fmt in BLOCK_FORMATS else 77)
    assert torch.equal(ops.dequantize(weight, isa), dequantize_reference(weight))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("shape", [(37, 96), (5, 320)])
def test_matmul_every_row_count(isa, fmt, shape):
    out_features, in_features = shape[0], width(fmt, shape[1])
    weight = random_weight(fmt, out_features, in_features, seed=out_features)
    dense = dequantize_reference(weight)
    x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(1))
    code = FORMATS[fmt].code
    for rows in range(1, 65):
        y = torch.empty(rows, out_features)
        _ext().matmul_(x[:rows], weight.data, code, in_features, y, 0, isa)
        assert_close_to_exact(y, x[:rows], dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_split_over_threads_equals_one_thread(isa, dtype, rows):
    # 1002 Q4_1 rows of 360 bytes (over the 64 KiB above which a call is split): two and three
    # threads cut it at rows that are not multiples of 4 (ragged GEMV groups and GEMM tiles at
    # the task edges). Each output feature is computed by one task from its own weight row, so
    # every split gives the one-thread result, and no task writes outside its columns.
    weight = random_weight("q4_1", 1002, 576)
    assert weight.data.numel() > 2**16
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            y = torch.full((rows, 1010), 7.0, dtype=dtype)
            _ext().matmul_(x, weight.data, FORMATS["q4_1"].code, 576, y, 5, isa)
            results.append(y)
    finally:
        torch.set_num_threads(threads)
    for y in results:
        assert torch.equal(y, results[0])
        assert torch.equal(y[:, :5], torch.full((rows, 5), 7.0, dtype=dtype))
        assert torch.equal(y[:, 1007:], torch.full((rows, 3), 7.0, dtype=dtype))
    if dtype == torch.float32:
        assert_close_to_exact(results[0][:, 5:1007], x, dequantize_reference(weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_matmul_writes_only_its_columns(isa, dtype, rows):
    weight = random_weight("q4_1", 9, 64)
    x = torch.randn(rows, 64).to(dtype)
    y = torch.full((rows, 20), 7.0, dtype=dtype)
    _ext().matmul_(x, weight.data, FORMATS["q4_1"].code, 64, y, 4, isa)
    assert torch.equal(y[:, :4], torch.full((rows, 4), 7.0, dtype=dtype))
    assert torch.equal(y[:, 13:], torch.full((rows, 7), 7.0, dtype=dtype))
    if dtype == torch.float32:
        assert_close_to_exact(y[:, 4:13], x, dequantize_reference(weight))
    else:  # bf16 results: checked to the bit in the bf16 tests below
        exact = x.double() @ dequantize_reference(weight).double().T
        if isa in INT8_X_ISAS:  # x quantized to int8 per block first
            exact = int8_x_reference(x, weight)[0]
        torch.testing.assert_close(y[:, 4:13].double(), exact, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_forced_variant_through_environment(isa, rows, monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV, isa)
    assert ops.kernel_isa() == isa
    weight = random_weight("q4_0", 40, 128)
    x = torch.randn(rows, 128)
    assert_close_to_exact(ops.matmul(x, [weight]), x, dequantize_reference(weight))


def test_unknown_forced_variant_warns_and_uses_the_fastest(monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV, "amx_int8_unwritten")
    with pytest.warns(RuntimeWarning, match="SPARSEKV_KERNEL_ISA"):
        assert ops.kernel_isa() == ""
    weight = random_weight("q8_0", 6, 64)
    x = torch.randn(2, 64)
    assert_close_to_exact(ops.matmul(x, [weight]), x, dequantize_reference(weight))


@pytest.mark.parametrize("fmt", BF16_FORMATS)
@X16_ISAS
def test_int8_x_non_finite_and_tiny_blocks(fmt, x16_isa):
    # A NaN or an infinity in a block makes that row's results NaN (not a finite value from a
    # saturated code); a block whose max |x| is below 2^-100 counts as zero. Other rows keep
    # their exact results.
    weight = random_weight(fmt, 16, 64, seed=10)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(11)).bfloat16()
    x[1, 5], x[2, 40], x[3, 0] = float("nan"), float("inf"), float("-inf")
    x[4, :32] = (x[4, :32].float() * 1e-37).bfloat16()  # a tiny block next to a normal one
    layouts = [(ops.repack_x16(weight).data, FORMATS[fmt + "x16"].code)]
    if x16_isa in INT8_X_ISAS:  # also its int8 kernel of the file's layout
        layouts.append((weight.data, FORMATS[fmt].code))
    for data, code in layouts:
        y = torch.empty(5, 16)
        _ext().matmul_(x, data, code, 64, y, 0, x16_isa)
        assert y[1:4].isnan().all(), fmt
        clean = x[[0, 4]].clone()
        reference, scale, _ = int8_x_reference(clean, weight)
        assert ((y[[0, 4]].double() - reference).abs() <= RTOL * scale + 1e-30).all()
        tiny_free = clean.clone()
        tiny_free[1, :32] = 0
        assert torch.equal(int8_x_reference(tiny_free, weight)[0], reference)


@pytest.mark.kernel_variant("packed_weights")
def test_kernel_rejects_bad_arguments():
    weight = random_weight("q4_1", 4, 64)
    with pytest.raises(RuntimeError, match="bytes"):
        _ext().matmul_(torch.randn(1, 96), weight.data, 1, 96, torch.empty(1, 4), 0, "")
    with pytest.raises(RuntimeError, match="do not fit"):
        _ext().matmul_(torch.randn(1, 64), weight.data, 1, 64, torch.empty(1, 3), 0, "")
    with pytest.raises(RuntimeError, match="do not fit"):  # col + n would overflow
        _ext().matmul_(torch.randn(1, 64), weight.data, 1, 64, torch.empty(1, 8), 2**63 - 2, "")
    with pytest.raises(RuntimeError, match="float32"):
        _ext().matmul_(torch.randn(1, 64).double(), weight.data, 1, 64, torch.empty(1, 4), 0, "")


def bf16_ulp(value: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at ``value`` (fp64; 8 significant bits)."""
    exponent = torch.frexp(value.double())[1]  # |value| in [2^(e-1), 2^e)
    return torch.ldexp(torch.ones_like(value, dtype=torch.float64), exponent - 8)


def int8_x_reference(x: torch.Tensor, weight: PackedTensor) -> tuple[torch.Tensor, ...]:
    """What the ``avx512_vnni`` variant computes for bf16 ``x`` (fp64): ``x`` quantized per block
    of 32 in two int8 levels as the kernel does in fp32 (high codes ``round(x * 127 / max|x|)``
    to nearest even, the residual ``x - high * max|x| / 127`` rounded once, in units of 1/256 of
    that step, saturated to +-127), times the weight's code part ``d (q - z)``, plus Q4_1's
    offsets ``m`` times the exact ``x``. Returns ``(reference, the fp32 accumulation scale, the
    x-rounding bound)``: the kernel is within ``RTOL`` times the scale of the reference, and the
    reference within the bound (``sum_blocks unit * sum |code part|``) of the exact product."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    blocks = torch.where(blocks.abs().amax(-1, keepdim=True) < 2.0**-100, 0.0, blocks)  # tiny
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    step = amax / 127.0
    high = (blocks * inverse).round()
    rest = (blocks.double() - high.double() * step.double()).float()  # one fused rounding
    low = (rest * (inverse * 256.0)).round().clamp(-127, 127)
    unit = (step / 256.0).double()
    xq = ((high.double() * 256.0 + low.double()) * unit).reshape(rows, k)
    dense = dequantize_reference(weight).double()
    offsets = torch.zeros_like(dense)
    if weight.format in OFFSET_AT:
        at = OFFSET_AT[weight.format]
        per_block = weight.data.reshape(dense.shape[0], k // 32, -1)[..., at : at + 2]
        offsets = per_block.contiguous().view(torch.float16)[..., 0].double()
        offsets = offsets.repeat_interleave(32, 1)
    codes = dense - offsets
    reference = xq @ codes.T + x.double() @ offsets.T
    scale = xq.abs() @ codes.abs().T + x.double().abs() @ offsets.abs().T
    units = unit.expand(rows, k // 32, 32).reshape(rows, k)
    return reference, scale, units @ codes.abs().T


def bf16_x_product(x: torch.Tensor, weight: PackedTensor, isa: str) -> torch.Tensor:
    """The fp64 product variant ``isa`` approximates for bf16 ``x`` on its kernels: the
    int8-activation reference on ``avx512_vnni``'s formats, else the exact product."""
    if isa in INT8_X_ISAS and weight.format in BF16_FORMATS:
        return int8_x_reference(x, weight)[0]
    return x.double() @ dequantize_reference(weight).double().T


@pytest.mark.parametrize("fmt", BF16_FORMATS)
@pytest.mark.parametrize("in_features", [64, 576, 1536])
def test_bf16_x_equals_fp64_reference(isa, fmt, in_features):
    # bf16 x, fp32 and bf16 y, with and without bias; 37 weight rows: ragged groups of 4. The
    # int8-activation variant is checked against the product of its quantized x (and that
    # within the rounding bound of the exact product), the others against the exact product.
    weight = random_weight(fmt, 37, in_features, seed=in_features)
    dense, code = dequantize_reference(weight).double(), FORMATS[fmt].code
    x = torch.randn(70, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    bias = torch.randn(37, generator=torch.Generator().manual_seed(3))
    for rows in (1, 2, 3, 5, 17, 64, 70):  # 70: two passes of 64 rows through the small GEMM
        xr = x[:rows]
        y32, y32_bias = torch.empty(rows, 37), torch.empty(rows, 37)
        y16, y16_bias = (torch.empty(rows, 37, dtype=torch.bfloat16) for _ in range(2))
        _ext().matmul_(xr, weight.data, code, in_features, y32, 0, isa)
        _ext().matmul_(xr, weight.data, code, in_features, y32_bias, 0, isa, bias)
        _ext().matmul_(xr, weight.data, code, in_features, y16, 0, isa)
        _ext().matmul_(xr, weight.data, code, in_features, y16_bias, 0, isa, bias)
        exact = xr.double() @ dense.T
        if isa in INT8_X_ISAS:
            reference, scale, rounding = int8_x_reference(xr, weight)
            assert ((y32.double() - reference).abs() <= RTOL * scale + 1e-30).all()
            assert ((reference - exact).abs() <= rounding * (1 + 1e-9) + 1e-30).all()
            assert (rounding > 0).all()  # the bound is not vacuous: x was rounded
        else:
            assert_close_to_exact(y32, xr.float(), dense)
            reference, scale = exact, xr.double().abs() @ dense.abs().T
        # The bias is added in fp32, then the sum is rounded once to nearest even.
        assert torch.equal(y32_bias, y32 + bias)
        assert torch.equal(y16, y32.bfloat16()) and torch.equal(y16_bias, y32_bias.bfloat16())
        # Within one bf16 ulp of the reference rounded to bf16, plus the fp32 accumulation
        # error bound (a result that nearly cancels to 0 has ulps far below that bound).
        error = (y16.double() - reference.bfloat16().double()).abs()
        bound = bf16_ulp(reference) + RTOL * scale
        assert (error <= bound).all(), f"{rows} rows: max excess {(error - bound).max():.2e}"


@pytest.mark.kernel_variant("packed_weights", "avx512_vnni")
@pytest.mark.parametrize("fmt", BF16_FORMATS)
def test_int8_x_rows_do_not_depend_on_the_batch(fmt):
    # The int8-activation kernels run one row of x and many through the same arithmetic in the
    # same order: a row's result is bit-identical alone and in any batch (a verification chunk
    # of speculative decoding equals the decode steps it replaces).
    weight = random_weight(fmt, 45, 576, seed=7)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    code = FORMATS[fmt].code
    alone = torch.empty(70, 45)
    for r in range(70):
        _ext().matmul_(x[r : r + 1], weight.data, code, 576, alone[r : r + 1], 0, "avx512_vnni")
    for rows in (2, 5, 16, 64, 70):
        batch = torch.empty(rows, 45)
        _ext().matmul_(x[:rows], weight.data, code, 576, batch, 0, "avx512_vnni")
        assert torch.equal(batch, alone[:rows]), f"{rows} rows"


@X16
def test_int8_x_quantization_edge_blocks():
    # An all-zero block contributes 0 (unit 0, no division by zero); a block of one huge and one
    # tiny value keeps the huge one exact and the tiny one in the residual level.
    weight = random_weight("q8_0", 8, 64, seed=9)
    dense = dequantize_reference(weight).double()
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1, 0], x[1, 1] = 512.0, 0.5
    y = torch.empty(2, 8)
    _ext().matmul_(x, weight.data, FORMATS["q8_0"].code, 64, y, 0, "avx512_vnni")
    assert torch.equal(y[0], torch.zeros(8))
    reference, scale, _ = int8_x_reference(x, weight)
    assert ((y.double() - reference).abs() <= RTOL * scale + 1e-30).all()
    # 0.5 is 0.124 high steps of 512 / 127: high code 0, residual round(31.75) = 32 units of
    # u = fp32(512 / 127) / 256, so x holds 512 as 127 * 256 u and 0.5 as 32 u = 0.504
    unit = torch.tensor(512.0 / 127.0, dtype=torch.float32).double() / 256
    kept = 127 * 256 * unit * dense[:, 0] + 32 * unit * dense[:, 1]
    assert torch.allclose(reference[1], kept, rtol=1e-12, atol=0)
    assert abs(127 * 256 * unit.item() - 512) < 1e-4


@pytest.mark.parametrize("rows", [1, 9])
def test_bf16_x_through_ops_and_forced_variant(isa, rows, monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV, isa)
    # A bf16-kernel format next to ones the variant converts x to fp32 for (Q4_K, int8 rows).
    parts = [random_weight("q4_1", 12, 256, 1), random_weight("q4_k", 6, 256, 2)]
    parts += [random_weight("q8_0", 6, 256, 3), random_weight("int8", 5, 256, 4)]
    bias = torch.randn(29)
    x = torch.randn(rows, 256).bfloat16()
    y = ops.matmul(x, parts, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 29)
    expected = torch.cat([ops.matmul(x.float(), [p]) for p in parts], dim=-1) + bias
    dense = torch.cat([dequantize_reference(p) for p in parts]).double()
    assert_close_to_exact(expected - bias, x.float(), dense)
    # the bf16-x kernels' own product (int8 x on avx512_vnni), rounded once to bf16
    product = torch.cat([bf16_x_product(x, p, isa) for p in parts], dim=-1) + bias.double()
    torch.testing.assert_close(y.double(), product, rtol=2**-8, atol=1e-4)


@pytest.mark.kernel_variant("packed_weights")
def test_kernel_rejects_bad_dtypes():
    weight, x = random_weight("q8_0", 4, 64), torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a CPU float32 or bfloat16"):
        _ext().matmul_(x.half(), weight.data, 2, 64, torch.empty(2, 4), 0, "")
    with pytest.raises(RuntimeError, match="y must be a CPU float32 or bfloat16"):
        _ext().matmul_(x, weight.data, 2, 64, torch.empty(2, 4, dtype=torch.float16), 0, "")
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous CPU float32 \[4\]"):
        _ext().matmul_(x, weight.data, 2, 64, torch.empty(2, 4), 0, "", torch.zeros(4).bfloat16())
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous CPU float32 \[4\]"):
        _ext().matmul_(x, weight.data, 2, 64, torch.empty(2, 4), 0, "", torch.zeros(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_mixed_parts_with_bias(dtype):
    # A fused QKV whose parts the file stores in different formats, plus a bias.
    parts = [random_weight("q4_1", 16, 64, 1), random_weight("q8_0", 8, 64, 2)]
    parts.append(random_weight("q4_0", 8, 64, 3))
    bias = torch.randn(32)
    layer = QuantizedLinear(parts, bias)
    dense = torch.cat([dequantize_reference(p) for p in parts])
    assert layer.out_features == 32 and layer.weight_bytes == 16 * 40 + 8 * 68 + 8 * 36
    for rows in (1, 5, ops.SMALL_M_MAX_ROWS, ops.SMALL_M_MAX_ROWS + 1, 130):
        x = torch.randn(rows, 64).to(dtype)
        expected = torch.nn.functional.linear(x.float(), dense, bias)
        y = layer(x)
        assert y.shape == (rows, 32) and y.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        else:
            if rows <= ops.SMALL_M_MAX_ROWS:  # the kernels' product (int8 x where quantized)
                isa = ops.kernel_isa() or ops.available_isas()[0]
                product = torch.cat([bf16_x_product(x, p, isa) for p in parts], dim=-1)
                expected = (product + bias.double()).float()
            torch.testing.assert_close(y.float(), expected, rtol=1.6e-2, atol=1e-2 * rows**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_merges_adjacent_parts_bit_identically(isa, dtype, monkeypatch):
    # Runs of one format become one kernel call; row counts not multiples of 4 shift the later
    # parts' rows into other groups of the GEMV / GEMM tiles, which must not change a bit.
    monkeypatch.setenv(ops.ISA_ENV, isa)
    parts = [random_weight("q4_1", 13, 64, 1), random_weight("q4_1", 7, 64, 2)]
    parts += [random_weight("q4_1", 8, 64, 3), random_weight("q8_0", 6, 64, 4)]
    parts += [random_weight("q8_0", 5, 64, 5), random_weight("q4_0", 9, 64, 6)]
    bias = torch.randn(48)
    layer = QuantizedLinear(parts, bias)
    calls, _ = layer.kernel_calls()
    assert [(code, n) for _, code, _, n in calls] == [(1, 28), (2, 11), (0, 9)]
    assert layer.formats == ("q4_1",) * 3 + ("q8_0",) * 2 + ("q4_0",)
    assert all(torch.equal(a.data, b.data) for a, b in zip(layer.parts, parts))
    for rows in (1, 3, 17, ops.SMALL_M_MAX_ROWS):
        x = torch.randn(rows, 64).to(dtype)
        separate = ops.matmul(x, parts, bias)  # one kernel call per part
        assert torch.equal(layer(x), separate)


def test_quantized_linear_rebuilds_its_calls_when_buffers_change():
    parts = [random_weight("q4_0", 8, 64, 1), random_weight("q4_0", 4, 64, 2)]
    layer = QuantizedLinear(parts, torch.randn(12))
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), ops.matmul(x, parts, layer.bias))
    other = random_weight("q4_0", 4, 64, 7)
    layer.packed_1 = other.data  # no longer the rows after packed_0's: two calls
    assert len(layer.kernel_calls()[0]) == 2
    assert torch.equal(layer(x), ops.matmul(x, [parts[0], other], layer.bias))
    layer.bfloat16()  # the bias buffer becomes bf16; the kernels still get it in fp32
    assert layer.bias.dtype == torch.bfloat16
    assert layer.kernel_calls()[1].dtype == torch.float32
    assert torch.equal(layer(x), ops.matmul(x, [parts[0], other], layer.bias.float()))


def test_native_scope_resolves_the_variant_once(monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV, "generic")
    with ops.native_scope():
        monkeypatch.setenv(ops.ISA_ENV, "avx2")  # read on entry only
        assert ops._resolved() == (_ext(), "generic")
        with ops.native_scope():
            assert ops._resolved() == (_ext(), "avx2")
        assert ops._resolved() == (_ext(), "generic")
    assert ops._scope.get() is None and ops._resolved() == (_ext(), "avx2")
    monkeypatch.setenv("SPARSEKV_DISABLE_NATIVE", "1")
    with ops.native_scope():
        assert ops._resolved() == (None, "")
        layer = QuantizedLinear([random_weight("q8_0", 4, 32)])
        x = torch.randn(1, 32)
        expected = x @ dequantize_reference(layer.parts[0]).T
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_native_scope_builds_nothing_before_the_extension_is_loaded(monkeypatch):
    # A model without packed weights enters the scope every step: it must not build the kernels.
    from sparsekv.models.quant import build

    def no_build():
        raise AssertionError("native_scope built the extension")

    monkeypatch.setattr(build, "is_loaded", lambda: False)
    monkeypatch.setattr(build, "load_extension", no_build)
    with ops.native_scope():
        assert ops._scope.get() is None  # per-call reads, as outside any scope
    assert ops._scope.get() is None


def test_quantized_linear_keeps_leading_dimensions():
    layer = QuantizedLinear([random_weight("q8_0", 10, 32)])
    x = torch.randn(2, 3, 32)
    expected = x @ dequantize_reference(layer.parts[0]).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_int8_quantization_is_per_channel_and_symmetric():
    w = torch.randn(6, 50) * torch.arange(1, 7).unsqueeze(1)
    w[3] = 0.0
    packed = quantize_int8(w)
    scale = packed.data[:, :4].contiguous().view(torch.float32).squeeze(1)
    expected = w.abs().amax(dim=1) / 127
    expected[3] = 1.0
    assert torch.equal(scale, expected)
    codes = packed.data[:, 4:].view(torch.int8)
    assert codes.abs().max() == 127 and codes.min() >= -127
    error = (dequantize_reference(packed) - w).abs()
    assert (error <= scale.unsqueeze(1) / 2 + 1e-7).all()


def test_packed_tensor_checks_its_layout():
    with pytest.raises(ValueError, match="divisible by 32"):
        PackedTensor("q4_0", 48, torch.zeros(2, 27, dtype=torch.uint8))
    with pytest.raises(ValueError, match="take 36 bytes"):
        PackedTensor("q4_0", 64, torch.zeros(2, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match="different formats"):
        cat_rows([random_weight("q4_0", 2, 32), random_weight("q8_0", 2, 32)])
    joined = cat_rows([random_weight("q4_0", 2, 32, 1), random_weight("q4_0", 3, 32, 2)])
    assert joined.shape == (5, 32)


def test_a_large_weight_takes_the_kernels_up_to_more_rows(monkeypatch):
    # An output head (bf16 copy over LARGE_DENSE_BYTES) stays on the kernels up to
    # LARGE_M_MAX_ROWS rows; the layer-sized weights switch to the dense path after 64.
    assert ops.kernel_max_rows(3072, 576) == ops.SMALL_M_MAX_ROWS == 64
    assert ops.kernel_max_rows(49152, 576) == ops.LARGE_M_MAX_ROWS == 96
    # x16 layouts: the int8 kernels stay the faster route up to X16_MAX_ROWS on every size.
    assert ops.kernel_max_rows(3072, 576, x16=True) == ops.X16_MAX_ROWS == 128
    assert ops.kernel_max_rows(49152, 576, x16=True) == ops.X16_MAX_ROWS
    head = QuantizedLinear([random_weight("q8_0", 16384, 576, 4)])  # 18.9 MB in bf16
    assert head.max_kernel_rows == ops.LARGE_M_MAX_ROWS
    dense = dequantize_reference(head.parts[0])
    routes = []
    real_dense = ops.dense_matmul
    monkeypatch.setattr(ops, "dense_matmul", lambda *a: routes.append("dense") or real_dense(*a))
    for rows in (80, ops.LARGE_M_MAX_ROWS, ops.LARGE_M_MAX_ROWS + 1):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        y = head(x)
        assert_close_to_exact(y, x, dense)
    assert routes == ["dense"]  # only the 97-row call


@pytest.mark.parametrize("fmt", BF16_FORMATS)
def test_x16_repack_round_trips_to_the_same_values(fmt):
    weight = random_weight(fmt, 48, 576, seed=5)
    x16 = ops.repack_x16(weight)
    assert x16.format == fmt + "x16" and x16.shape == weight.shape
    assert x16.data.shape == (3, 18 * FORMATS[fmt].block_bytes * 16)
    assert x16.nbytes == weight.nbytes
    assert torch.equal(unpack_x16_reference(x16).data, weight.data)
    assert torch.equal(_ext().unpack_x16(x16.data, FORMATS[x16.format].code, 576), weight.data)
    assert torch.equal(dequantize_reference(x16), dequantize_reference(weight))
    assert torch.equal(ops.dequantize(x16), dequantize_reference(weight))
    # row 16 g + i of the weight is lane i of group g: its scale d is the group-block's i-th
    d = weight.data.reshape(48, 18, -1)[17, 3, :2]
    assert torch.equal(x16.data.reshape(3, 18, -1)[1, 3, 2:4], d)


def test_x16_repack_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        ops.repack_x16(random_weight("q4_1", 40, 64))
    with pytest.raises(ValueError, match="q4_k with 16 rows"):
        ops.repack_x16(random_weight("q4_k", 16, 256))
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        _ext().repack_x16(random_weight("q8_0", 8, 64).data, FORMATS["q8_0"].code, 64)
    with pytest.raises(ValueError, match="1088 bytes"):  # a group row of k = 64 holds 2 x 544
        PackedTensor("q8_0x16", 64, torch.zeros(2, 1088 + 64, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", BF16_FORMATS)
@pytest.mark.parametrize("in_features", [64, 96, 288, 576, 1536])  # 288, 96: odd block counts
@X16_ISAS
def test_x16_kernel_equals_the_int8_reference(fmt, in_features, x16_isa):
    weight = random_weight(fmt, 48, in_features, seed=in_features + 1)
    x16 = ops.repack_x16(weight)
    code = FORMATS[x16.format].code
    x = torch.randn(128, in_features, generator=torch.Generator().manual_seed(6)).bfloat16()
    bias = torch.randn(48, generator=torch.Generator().manual_seed(7))
    # up to X16_MAX_ROWS; avx512_amx: tiles from 4 rows, 8 rows a product, passes of 64
    for rows in (1, 2, 3, 4, 5, 8, 13, 17, 64, 70, 128):
        xr = x[:rows]
        y32, y32_bias = torch.empty(rows, 50), torch.empty(rows, 50)
        y16 = torch.empty(rows, 48, dtype=torch.bfloat16)
        _ext().matmul_(xr, x16.data, code, in_features, y32, 1, x16_isa)
        _ext().matmul_(xr, x16.data, code, in_features, y32_bias, 1, x16_isa, bias)
        _ext().matmul_(xr, x16.data, code, in_features, y16, 0, x16_isa)
        reference, scale, _ = int8_x_reference(xr, weight)
        assert ((y32[:, 1:49].double() - reference).abs() <= RTOL * scale + 1e-30).all()
        assert torch.equal(y32_bias[:, 1:49], y32[:, 1:49] + bias)
        assert torch.equal(y16, y32[:, 1:49].bfloat16())


@pytest.mark.parametrize("fmt", BF16_FORMATS)
@X16_ISAS
def test_x16_rows_do_not_depend_on_the_batch_or_the_threads(fmt, x16_isa):
    weight = ops.repack_x16(random_weight(fmt, 1024, 576, seed=8))  # 2 threads split it
    code = FORMATS[weight.format].code
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(9)).bfloat16()
    alone = torch.empty(70, 1024)
    for r in range(70):
        _ext().matmul_(x[r : r + 1], weight.data, code, 576, alone[r : r + 1], 0, x16_isa)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in (2, 5, 16, 70):
                batch = torch.empty(rows, 1024)
                _ext().matmul_(x[:rows], weight.data, code, 576, batch, 0, x16_isa)
                assert torch.equal(batch, alone[:rows]), f"{rows} rows on {count} threads"
    finally:
        torch.set_num_threads(threads)


def extreme_x16_case(fmt: str, k: int = 576) -> tuple[torch.Tensor, int, torch.Tensor]:
    """An x16 weight ``[64, k]`` (data, format code) and bf16 ``x [72, k]`` (``k`` a multiple
    of 32, at least 256) at the edges of the int8 arithmetic: extreme codes (Q8_0's -128), NaN /
    infinite / tiny / all-equal blocks, blocks of x over 60 orders of magnitude."""
    weight = random_weight(fmt, 64, k, seed=12)
    if fmt == "q8_0":  # every code -128 in the first row's first block
        layout = FORMATS[fmt]
        weight.data[0, 2 : layout.block_bytes] = 0x80
    x16 = ops.repack_x16(weight)
    g = torch.Generator().manual_seed(13)
    magnitude = 10.0 ** torch.randint(-30, 30, (72, k // 32), generator=g)  # per block of 32
    x = (torch.randn(72, k, generator=g) * magnitude.repeat_interleave(32, dim=1)).bfloat16()
    x[3, 7], x[5, 100], x[6, 200] = float("nan"), float("inf"), float("-inf")
    x[7, :32] = 0.0
    x[8, :32] = -127.0  # codes at the ends of the range
    return x16.data, FORMATS[x16.format].code, x


def assert_same_results(a: torch.Tensor, b: torch.Tensor, what) -> None:
    """``a`` and ``b`` equal bit for bit, NaNs in the same places."""
    assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), what
    assert torch.equal(a.isnan(), b.isnan()), what


@X16  # a CPU with AVX512-VNNI runs AVX2 too
@pytest.mark.parametrize("fmt", BF16_FORMATS)
def test_avx2_x16_kernel_equals_avx512_vnni_bit_for_bit(fmt):
    # The AVX2 kernels sum the same integers (vpmaddubsw / vpmaddwd for vpdpbusd) and do the
    # same fp32 operations per output in the same order, quantization of x included.
    data, code, x = extreme_x16_case(fmt)
    for rows in (1, 3, 16, 40):
        y = {isa: torch.empty(rows, 64) for isa in ("avx2", "avx512_vnni")}
        for isa in y:
            _ext().matmul_(x[:rows], data, code, 576, y[isa], 0, isa)
        assert_same_results(y["avx2"], y["avx512_vnni"], rows)


@pytest.mark.kernel_variant("packed_weights", "avx512_amx")  # AMX-INT8 CPUs have AVX512-VNNI
@pytest.mark.parametrize("fmt", BF16_FORMATS)
@pytest.mark.parametrize("k", [576, 288])  # 18 blocks: chunks of 8, 8, 2; 9: 8, then one
def test_amx_x16_kernel_equals_avx512_vnni_bit_for_bit(fmt, k):
    # The tile products are the same int32 sums per block and level, and the per-row fp32
    # arithmetic follows in the same order: below the tiles' threshold (the VNNI kernel itself),
    # one product of 4-8 rows, ragged products, two passes of 64 rows.
    data, code, x = extreme_x16_case(fmt, k)
    for rows in (3, 4, 5, 7, 8, 9, 16, 40, 64, 72):
        y = {isa: torch.empty(rows, 64) for isa in ("avx512_amx", "avx512_vnni")}
        for isa in y:
            _ext().matmul_(x[:rows], data, code, k, y[isa], 0, isa)
        assert_same_results(y["avx512_amx"], y["avx512_vnni"], rows)


@pytest.mark.parametrize("variant", ["", "avx512_bf16", "generic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x16_parts_run_densely_where_no_kernel_reads_them(variant, dtype, monkeypatch):
    # fp32 x, or a variant without x16 kernels: the x16 parts take the dense path (exact in
    # fp32) next to kernel-run parts, in output order, with the bias.
    if variant:
        monkeypatch.setenv(ops.ISA_ENV, variant)
    source = [random_weight("q4_1", 32, 256, 1), random_weight("q4_k", 8, 256, 2)]
    source.append(random_weight("q8_0", 16, 256, 3))
    parts = [ops.repack_x16(source[0]), source[1], ops.repack_x16(source[2])]
    bias = torch.randn(56)
    x = torch.randn(3, 256).to(dtype)
    y = QuantizedLinear(parts, bias)(x)
    expected = QuantizedLinear(source, bias)(x.float() if dtype == torch.float32 else x)
    kernels = dtype == torch.bfloat16 and ops.x16_runs()
    if dtype == torch.float32 or not kernels:
        dense = torch.cat([dequantize_reference(p) for p in source]).double()
        exact = x.double() @ dense.T + bias.double()
        tol = (
            {"rtol": 1e-5, "atol": 1e-5}
            if dtype == torch.float32
            else {"rtol": 2**-8, "atol": 1e-4}
        )
        torch.testing.assert_close(y.double(), exact, **tol)
    else:  # the x16 kernels: the quad kernels' products up to fp32 accumulation order
        torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=1e-3)


@X16
def test_x16_weights_need_bf16_x_in_the_kernel_op():
    weight = ops.repack_x16(random_weight("q4_0", 16, 64))
    with pytest.raises(RuntimeError, match="x16-repacked weights need bf16 x"):
        _ext().matmul_(torch.randn(1, 64), weight.data, 8, 64, torch.empty(1, 16), 0, "")
    with pytest.raises(RuntimeError, match="x16-repacked weights need bf16 x"):
        x = torch.randn(1, 64).bfloat16()
        _ext().matmul_(x, weight.data, 8, 64, torch.empty(1, 16), 0, "avx512_bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_merges_adjacent_x16_parts(dtype):
    # A fused QKV of three Q4_1 tensors repacked: one kernel call over 3 x 2 groups; prefill
    # sizes take the dense path, slicing groups.
    source = [random_weight("q4_1", 32, 64, s) for s in (1, 2, 3)]
    parts = [ops.repack_x16(p) for p in source]
    layer = QuantizedLinear(parts)
    calls, _ = layer.kernel_calls()
    assert [(code, n, data.shape[0]) for data, code, _, n in calls] == [(9, 96, 6)]
    assert layer.out_features == 96 and layer.weight_bytes == 3 * 32 * 40
    assert layer.max_kernel_rows == ops.X16_MAX_ROWS
    for rows in (1, 5, ops.SMALL_M_MAX_ROWS + 3, ops.X16_MAX_ROWS + 3):
        x = torch.randn(rows, 64).to(dtype)
        if rows <= ops.X16_MAX_ROWS:
            assert torch.equal(layer(x), ops.matmul(x, parts))  # one call = one per part
        else:  # the dense path sees the source's values
            assert torch.equal(layer(x), QuantizedLinear(source)(x))
