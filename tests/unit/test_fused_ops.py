"""Fused elementwise ops (``sparsekv.models.fused``) against the eager code they replace.

Every native variant this CPU runs is checked (``avx512``, ``avx2``, ``generic``): fp32 to
~1e-6 relative, bf16 to at most 1 ulp, and bit-identical where the kernels promise it (residual
sums; rotary on FMA variants). Shapes cover 0 and 1 rows, odd widths and the model sizes
(SmolLM2 576 / 1536, Gemma 3 270M 640, Gemma 3 1B 1152), strided views, and the eager fallback.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from sparsekv.models.fused import build, ops, reference
from sparsekv.models.layers import GatedMLP, RMSNorm

DTYPES = (torch.float32, torch.bfloat16)


def _ext():
    ext = build.load_extension()
    if ext is None and build.fused_disabled():
        pytest.skip("fused ops disabled on purpose")
    assert ext is not None, "the fused ops failed to build"
    return ext


ISAS = ("avx512", "avx2", "generic")


def _ordered(t: torch.Tensor) -> torch.Tensor:
    # bf16 bit patterns as integers whose differences count ulps (sign-magnitude -> ordered).
    bits = t.contiguous().view(torch.int16).int() & 0xFFFF
    return torch.where(bits >= 0x8000, 0x8000 - bits, bits)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, max_ulps: int = 1) -> None:
    """fp32: 1e-6 relative (plus 1e-7 absolute near 0); bf16: at most ``max_ulps`` ulps."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)
        return
    ulps = (_ordered(actual) - _ordered(expected)).abs()
    assert ulps.numel() == 0 or ulps.max().item() <= max_ulps, ulps.max().item()


def _weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n)).to(dtype)


@pytest.fixture(
    params=[pytest.param(isa, marks=pytest.mark.kernel_variant("fused", isa)) for isa in ISAS]
)
def isa(request) -> str:
    # Variants this CPU cannot run are deselected and named in the run's summary.
    assert request.param in _ext().available_isas().split(",")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 33])
@pytest.mark.parametrize("n", [576, 640, 1152, 5])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm(isa, dtype, rows, n, unit_offset):
    torch.manual_seed(rows * n)
    x = (3 * torch.randn(rows, n)).to(dtype)
    weight = _weight(n, dtype)
    actual = _ext().rms_norm(x, weight, 1e-6, unit_offset, isa)
    assert_matches(actual, reference.rms_norm(x, weight, 1e-6, unit_offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 33])
@pytest.mark.parametrize("n", [576, 640, 1152, 5])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm(isa, dtype, rows, n, unit_offset):
    torch.manual_seed(rows * n + 1)
    hidden, delta = (3 * torch.randn(2, rows, n)).to(dtype)
    weight = _weight(n, dtype)
    total, normed = _ext().add_rms_norm(hidden, delta, weight, 1e-5, unit_offset, isa)
    expected_total, expected_normed = reference.add_rms_norm(
        hidden, delta, weight, 1e-5, unit_offset
    )
    assert torch.equal(total, expected_total)  # the residual stream itself: bit-identical
    assert_matches(normed, expected_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp32_weight_on_bf16_input(isa, dtype):
    x = torch.randn(4, 576).to(dtype)
    weight = _weight(576, torch.float32)
    assert_matches(
        _ext().rms_norm(x, weight, 1e-5, False, isa), reference.rms_norm(x, weight, 1e-5)
    )


def test_rms_norm_strided_views(isa):
    # Gemma's q-norm input: the query heads of a fused QKV row, [T, H, d] with a token stride
    # larger than H * d (no copy), and a transposed tensor (last dim strided: copied first).
    torch.manual_seed(0)
    qkv = torch.randn(9, (4 + 2 * 1) * 256).to(torch.bfloat16)
    q = qkv[:, : 4 * 256].view(9, 4, 256)
    weight = _weight(256, torch.bfloat16)
    assert_matches(
        _ext().rms_norm(q, weight, 1e-6, True, isa), reference.rms_norm(q, weight, 1e-6, True)
    )
    xt = torch.randn(576, 5).t()
    weight = _weight(576, torch.float32)
    actual = _ext().rms_norm(xt, weight, 1e-6, False, isa)
    assert actual.is_contiguous()
    assert_matches(actual, reference.rms_norm(xt, weight, 1e-6))
    three_levels = torch.randn(3, 4, 5, 16)[:, :, ::2]  # leading dims that do not collapse
    weight = _weight(16, torch.float32)
    assert_matches(
        _ext().rms_norm(three_levels, weight, 1e-6, False, isa),
        reference.rms_norm(three_levels, weight, 1e-6),
    )


def test_add_rms_norm_strided(isa):
    hidden = torch.randn(8, 1280)[:, :640]
    delta = torch.randn(640, 8).t()
    weight = _weight(640, torch.float32)
    total, normed = _ext().add_rms_norm(hidden, delta, weight, 1e-6, True, isa)
    expected_total, expected_normed = reference.add_rms_norm(hidden, delta, weight, 1e-6, True)
    assert torch.equal(total, expected_total)
    assert_matches(normed, expected_normed)


GLU = ("silu_mul", "gelu_tanh_mul")


@pytest.mark.parametrize("name", GLU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 33])
@pytest.mark.parametrize("n", [1536, 640, 5])
def test_gated_activation(isa, name, dtype, rows, n):
    torch.manual_seed(rows + n)
    gate_up = (3 * torch.randn(rows, 2 * n)).to(dtype)
    actual = getattr(_ext(), name)(gate_up, isa)
    expected = getattr(reference, name)(gate_up)
    if dtype == torch.float32:
        # Eager tanh-GELU cancels in 1 + tanh for x < -4 (error ~6e-8 * |x|): absolute there.
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        assert_matches(actual, expected)


@pytest.mark.parametrize("name", GLU)
def test_gated_activation_every_bf16_value(isa, name):
    # The activation alone (up = 1) on every finite bf16 value, including both tails.
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = codes.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    gate_up = torch.cat([x, torch.ones_like(x)])[None]
    actual = getattr(_ext(), name)(gate_up, isa)
    expected = getattr(reference, name)(gate_up)
    assert_matches(actual, expected)


@pytest.mark.parametrize("name", GLU)
def test_gated_activation_strided(isa, name):
    gate_up = torch.randn(10, 2 * 96)[::2]  # row stride twice the row length
    assert_matches(getattr(_ext(), name)(gate_up, isa), getattr(reference, name)(gate_up))
    transposed = torch.randn(2 * 96, 4).t()
    assert_matches(getattr(_ext(), name)(transposed, isa), getattr(reference, name)(transposed))


def _cos_sin(num_tokens: int, head_dim: int, dtype: torch.dtype):
    positions = torch.arange(num_tokens) * 37
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None]
    cos = freqs.cos().repeat(1, 2)
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return cos.to(dtype)[:, None], signed_sin.to(dtype)[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
@pytest.mark.parametrize("head_dim", [64, 256, 6])
def test_rotary_in_place_on_qkv_view(isa, dtype, num_tokens, head_dim):
    # Llama's use: the query and key heads of the fused projection, rotated in place.
    torch.manual_seed(head_dim)
    qkv = torch.randn(num_tokens, 9 + 3 + 3, head_dim).to(dtype)
    before = qkv.clone()
    cos, signed_sin = _cos_sin(num_tokens, head_dim, dtype)
    expected = reference.apply_rotary(before[:, :12], cos, signed_sin)
    _ext().rotary_(qkv[:, :12], cos, signed_sin, isa)
    assert torch.equal(qkv[:, 12:], before[:, 12:])  # values untouched
    if isa == "generic" and dtype == torch.float32:
        # No FMA in the baseline variant; eager's AVX kernels fuse the multiply-add.
        torch.testing.assert_close(qkv[:, :12], expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(qkv[:, :12], expected)


def test_rotary_rejects_bad_layouts(isa):
    ext = _ext()
    cos, signed_sin = _cos_sin(4, 8, torch.float32)
    strided_last = torch.randn(4, 2, 16)[..., ::2]
    with pytest.raises(RuntimeError, match="contiguous in its last dimension"):
        ext.rotary_(strided_last, cos, signed_sin, isa)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ext.rotary_(torch.randn(4, 2, 8), cos.bfloat16(), signed_sin.bfloat16(), isa)
    with pytest.raises(RuntimeError, match="head_dim"):
        ext.rotary_(torch.randn(4, 2, 7), cos, signed_sin, isa)


def test_argument_errors():
    ext = _ext()
    with pytest.raises(RuntimeError, match="not supported"):
        ext.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, False, "no-such-isa")
    with pytest.raises(RuntimeError, match="weight must be"):
        ext.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext.rms_norm(torch.randn(2, 8).half(), torch.ones(8), 1e-6, False)
    with pytest.raises(RuntimeError, match="delta must have"):
        ext.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6, False)
    with pytest.raises(RuntimeError, match="even"):
        ext.silu_mul(torch.randn(2, 7))


def test_wrapper_strided_rotary_falls_back_in_place():
    # ops.rotary_ takes any x: a last dimension the kernel cannot write goes through eager.
    x = torch.randn(4, 2, 16)[..., ::2]
    before = x.clone()
    cos, signed_sin = _cos_sin(4, 8, torch.float32)
    assert ops.rotary_(x, cos, signed_sin) is x
    assert torch.equal(x, reference.apply_rotary(before, cos, signed_sin))


@pytest.mark.parametrize("env", ["SPARSEKV_DISABLE_NATIVE", "SPARSEKV_DISABLE_FUSED_OPS"])
def test_disabled_uses_eager_code(monkeypatch, env):
    monkeypatch.setenv(env, "1")
    assert build.load_extension() is None
    torch.manual_seed(0)
    x, delta = torch.randn(2, 5, 64).bfloat16()
    weight = _weight(64, torch.bfloat16)
    assert torch.equal(
        ops.rms_norm(x, weight, 1e-6, True), reference.rms_norm(x, weight, 1e-6, True)
    )
    total, normed = ops.add_rms_norm(x, delta, weight, 1e-6)
    expected = reference.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, expected[0]) and torch.equal(normed, expected[1])
    gate_up = torch.randn(5, 128).bfloat16()
    assert torch.equal(ops.silu_mul(gate_up), reference.silu_mul(gate_up))
    assert torch.equal(ops.gelu_tanh_mul(gate_up), reference.gelu_tanh_mul(gate_up))
    qk = torch.randn(5, 3, 64).bfloat16()
    cos, signed_sin = _cos_sin(5, 64, torch.bfloat16)
    expected = reference.apply_rotary(qk, cos, signed_sin)
    assert torch.equal(ops.rotary_(qk, cos, signed_sin), expected)


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken(verbose: bool = False):
        raise RuntimeError("no compiler")

    monkeypatch.delenv("SPARSEKV_DISABLE_NATIVE", raising=False)
    monkeypatch.delenv("SPARSEKV_DISABLE_FUSED_OPS", raising=False)
    monkeypatch.setattr(build, "compile_extension", broken)
    build._load_once.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no compiler"):
            assert build.load_extension() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second call does not warn again
            assert build.load_extension() is None
            x = torch.randn(3, 16)
            assert torch.equal(
                ops.rms_norm(x, torch.ones(16), 1e-6), reference.rms_norm(x, torch.ones(16), 1e-6)
            )
    finally:
        build._load_once.cache_clear()  # later tests load the real extension again


def test_autograd_inputs_use_eager_code():
    norm = RMSNorm(32, 1e-6)
    x = torch.randn(3, 32, requires_grad=True)
    out = norm(x)
    assert out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_modules_match_eager(dtype):
    # The model's building blocks through the public wrappers (native if built).
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_weight(576, dtype))
        hidden, delta = torch.randn(2, 6, 576).to(dtype)
        total, normed = norm.add_and_norm(hidden, delta)
        assert torch.equal(total, hidden + delta)
        assert_matches(normed, reference.rms_norm(hidden + delta, norm.weight, 1e-5))
        first, first_normed = norm.add_and_norm(None, hidden)
        assert first is hidden
        assert_matches(first_normed, reference.rms_norm(hidden, norm.weight, 1e-5))
        mlp = GatedMLP(576, 1536, "silu").to(dtype)
        expected = mlp.down_proj(reference.silu_mul(mlp.gate_up_proj(hidden)))
        # A 1-ulp difference of one activation moves the bf16 matmul by more than 1 ulp.
        torch.testing.assert_close(mlp(hidden), expected)


def test_gated_mlp_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        GatedMLP(8, 16, "relu")


@pytest.mark.parametrize(
    "setting, wanted",
    [
        ("avx2", "avx2"),
        ("AVX2_W16", "avx2"),
        ("generic", "generic"),
        ("avx512_amx", "avx512"),
        ("avx512_bf16", "avx512"),
        ("avx512", "avx512"),
        ("no_such_variant", ""),
        ("", ""),
    ],
)
def test_kernel_isa_setting_caps_the_variant(monkeypatch, setting, wanted):
    available = _ext().available_isas().split(",")
    monkeypatch.setenv("SPARSEKV_KERNEL_ISA", setting)
    expected = wanted if wanted in available else available[0]
    assert ops.fused_isa() == expected
    with ops.native_scope():
        assert ops.fused_isa() == expected
    # Unset inside the scope: the scope keeps what it resolved on entry.
    with ops.native_scope():
        monkeypatch.delenv("SPARSEKV_KERNEL_ISA")
        assert ops.fused_isa() == expected
    assert ops.fused_isa() == available[0]


class _RecordingExtension:
    """Stands in for the operator namespace: records the variant each op is called with and
    runs the real kernel with it."""

    def __init__(self, ext):
        self.ext, self.calls = ext, []

    def available_isas(self):
        return self.ext.available_isas()

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args[-1]))
            return getattr(self.ext, name)(*args)

        return call


def test_every_op_runs_the_variant_the_setting_names(monkeypatch):
    recorder = _RecordingExtension(_ext())
    monkeypatch.setattr(build, "load_extension", lambda: recorder)
    monkeypatch.setenv("SPARSEKV_KERNEL_ISA", "generic")
    x = torch.randn(3, 64)
    expected = reference.rms_norm(x, torch.ones(64), 1e-6)
    with ops.native_scope():
        assert_matches(ops.rms_norm(x, torch.ones(64), 1e-6), expected)
        ops.add_rms_norm(x, x, torch.ones(64), 1e-6)
        ops.silu_mul(x)
        ops.gelu_tanh_mul(x)
        ops.rotary_(x.view(3, 2, 32), torch.ones(3, 1, 32), torch.zeros(3, 1, 32))
    assert recorder.calls == [
        ("rms_norm", "generic"),
        ("add_rms_norm", "generic"),
        ("silu_mul", "generic"),
        ("gelu_tanh_mul", "generic"),
        ("rotary_", "generic"),
    ]


@pytest.mark.parametrize(
    "setting, allowed",
    [
        ("", (True, True)),
        ("no_such_variant", (True, True)),
        ("avx512_amx", (True, True)),
        ("avx512_bf16", (True, False)),
        ("avx512_vnni", (False, False)),
        ("avx512", (False, False)),
        ("avx2", (False, False)),
        ("generic", (False, False)),
    ],
)
def test_kernel_isa_setting_caps_the_bf16_matmul_kernels(monkeypatch, setting, allowed):
    from sparsekv.models import prepack

    monkeypatch.setenv("SPARSEKV_KERNEL_ISA", setting)
    assert ops.bf16_matmul_kernels_allowed() == allowed
    ext = _ext()
    gemv, small_gemm = prepack._native_ops()
    assert (gemv is not None) == (allowed[0] and ext.has_gemv_bf16())
    assert (small_gemm is not None) == (allowed[1] and ext.has_gemm_bf16_small())
