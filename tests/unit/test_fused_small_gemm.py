"""The native small-M bf16 GEMM (``gemm_bf16_small``, AMX) and ``PackedLinear``'s dispatch to it.

The kernel accumulates exact bf16 products in fp32 and rounds once, so against an fp32 reference
on the same bf16 inputs it is off by at most half a bf16 ulp of the result (2^-9 relative; 2^-8
allowed) plus the fp32 accumulation error (at most ~k * 2^-24 of sum |x w|; 1e-4 allowed for
k <= 1536). That is tighter than the rtol 1.6e-2 / atol 1e-2 of a generic bf16 comparison.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsekv.models import prepack
from sparsekv.models.fused import build


def _small_gemm():
    ext = build.load_extension()
    assert ext is not None, "the fused ops failed to build"
    assert ext.has_gemm_bf16_small(), "deselected where the CPU has no AMX small-M GEMM"
    return ext.gemm_bf16_small


def assert_bf16_linear(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``actual`` is ``x @ weight.T`` with fp32 accumulation and one bf16 rounding."""
    reference = x.float() @ weight.float().t()
    magnitude = x.float().abs() @ weight.float().abs().t()
    assert actual.dtype == torch.bfloat16 and actual.shape == reference.shape
    error = (actual.float() - reference).abs()
    bound = 2.0**-8 * reference.abs() + 1e-4 * magnitude + 1e-30
    assert bool((error <= bound).all()), (error - bound).max().item()


ROWS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 48, 100]


@pytest.mark.parametrize(
    "shape",
    [(7, 33), (65, 31), (100, 70), (576, 576), (960, 576), (192, 576), (1000, 576), (576, 1536)],
)
@pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx")
@pytest.mark.parametrize("rows", ROWS)
def test_small_gemm_matches_fp32_reference(shape, rows):
    gemm = _small_gemm()
    torch.manual_seed(rows * 7 + shape[0])
    weight = torch.randn(shape, dtype=torch.bfloat16)
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    assert_bf16_linear(gemm(x, weight), x, weight)


@pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx")
@pytest.mark.parametrize("rows", [2, 16, 32])
def test_small_gemm_lm_head_shape(rows):
    gemm = _small_gemm()
    torch.manual_seed(rows)
    weight = torch.randn(49152, 576, dtype=torch.bfloat16)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    assert_bf16_linear(gemm(x, weight), x, weight)


@pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx")
def test_small_gemm_strided_inputs():
    gemm = _small_gemm()
    torch.manual_seed(0)
    weight = torch.randn(130, 96, dtype=torch.bfloat16)
    wide = torch.randn(20, 300, dtype=torch.bfloat16)
    for x in (wide[:, 7:103], wide[::2, 7:103], wide[:, :192:2], wide[:, :96].t().t()):
        assert_bf16_linear(gemm(x, weight), x, weight)
    transposed = torch.randn(96, 5, dtype=torch.bfloat16).t()  # column-major rows
    assert_bf16_linear(gemm(transposed, weight), transposed, weight)


@pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx")
def test_small_gemm_special_values():
    gemm = _small_gemm()
    weight = torch.ones(48, 64, dtype=torch.bfloat16)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    x[1, 5] = float("inf")
    x[2, 9] = float("nan")
    y = gemm(x, weight)
    assert torch.equal(y[0], torch.zeros(48, dtype=torch.bfloat16))
    assert bool(torch.isinf(y[1]).all()) and bool(torch.isnan(y[2]).all())


@pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx")
def test_small_gemm_empty_and_argument_errors():
    gemm = _small_gemm()
    weight = torch.randn(16, 32, dtype=torch.bfloat16)
    assert gemm(torch.empty(0, 32, dtype=torch.bfloat16), weight).shape == (0, 16)
    with pytest.raises(RuntimeError):
        gemm(torch.randn(2, 31, dtype=torch.bfloat16), weight)  # k mismatch
    with pytest.raises(RuntimeError):
        gemm(torch.randn(2, 32), weight)  # fp32 input
    with pytest.raises(RuntimeError):
        gemm(torch.randn(2, 32, dtype=torch.bfloat16), weight.t().contiguous().t())


def _packed(out_features: int = 832, in_features: int = 576, **kwargs) -> prepack.PackedLinear:
    if not prepack.can_prepack(torch.bfloat16, "cpu", True):
        pytest.skip("no oneDNN packing")
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False).bfloat16()
    try:
        return prepack.PackedLinear(linear, **kwargs)
    except RuntimeError:
        pytest.skip("oneDNN without bf16 packing")


@pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx")
def test_packed_linear_dispatches_by_row_count(monkeypatch):
    _small_gemm()
    packed = _packed()
    calls = []
    original = packed._small_gemm
    monkeypatch.setattr(packed, "_small_gemm", lambda x, w: calls.append(len(x)) or original(x, w))
    x = torch.randn(40, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 2, 16, prepack.SMALL_GEMM_MAX_ROWS, prepack.SMALL_GEMM_MAX_ROWS + 1, 40):
            assert_bf16_linear(packed(x[:rows]), x[:rows], packed._plain_weight)
    assert calls == [2, 16, prepack.SMALL_GEMM_MAX_ROWS]  # one row: the GEMV; above: oneDNN


def test_packed_linear_without_native_kernels_uses_onednn(monkeypatch):
    monkeypatch.setattr(prepack, "_native_ops", lambda: (None, None))  # a CPU without them
    for packed in (_packed(), _packed(native=False)):
        assert packed._plain_weight is None
        x = torch.randn(5, 576, dtype=torch.bfloat16)
        with torch.inference_mode():
            for rows in (1, 2, 5):
                assert torch.equal(packed(x[:rows]), packed.onednn(x[:rows]))


class _TiedLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden).bfloat16()
        self.proj = nn.Linear(hidden, hidden, bias=False).bfloat16()
        self.lm_head = nn.Linear(hidden, vocab, bias=False).bfloat16()
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx")
@pytest.mark.parametrize("tied", [True, False])
def test_tied_lm_head_reads_the_embedding(tied):
    _small_gemm()
    if not prepack.can_prepack(torch.bfloat16, "cpu", True):
        pytest.skip("no oneDNN packing")
    model = _TiedLM(8192, 576, tied)  # 9 MiB: above GEMV_MAX_WEIGHT_BYTES
    assert prepack.prepack_linears(model) == 2
    head = model.lm_head
    if tied:  # the native kernels read the embedding table itself: no copy
        assert head._plain_weight.data_ptr() == model.embed_tokens.weight.data_ptr()
        assert head._gemv is None  # one row: the small-M GEMM
        x = torch.randn(4, 576, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert_bf16_linear(head(x), x, model.embed_tokens.weight.detach())
            assert_bf16_linear(head(x[:1]), x[:1], model.embed_tokens.weight.detach())
    else:  # an untied large weight is not kept twice
        assert head._plain_weight is None
    assert model.proj._plain_weight is not None
