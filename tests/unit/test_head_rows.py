"""Logits over the leading token ids (``models.head_rows``): every head type gives exactly the
first columns of its full product, reading only the first weight rows where it can."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsekv.models import prepack
from sparsekv.models.head_rows import leading_rows, reads_leading_rows
from sparsekv.models.quant import ops
from sparsekv.models.quant.linear import QuantizedLinear
from tests.model.family_models import VOCAB
from tests.model.spec_models import engine, tiny_checkpoint
from tests.unit.test_packed_weights import random_weight

IN_FEATURES = 128


def _x(rows: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows)).to(dtype)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "int8"])
@pytest.mark.parametrize("rows", [1, 5])
def test_packed_head_rows_are_the_full_products_columns(fmt, rows):
    head = QuantizedLinear([random_weight(fmt, 96, IN_FEATURES, seed=3)])
    x = _x(rows)
    with torch.inference_mode():
        full = head(x)
        for num_rows in (16, 48, 96):
            assert torch.equal(leading_rows(head, x, num_rows), full[:, :num_rows])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_x16_head_rows_read_only_their_groups(fmt):
    if not ops.available_isas():
        pytest.skip("x16 layouts need the native packed-weight kernels (repack_x16)")
    head = QuantizedLinear([ops.repack_x16(random_weight(fmt, 96, IN_FEATURES, seed=4))])
    x = _x(3)
    with torch.inference_mode():
        full = head(x)
        assert torch.equal(leading_rows(head, x, 32), full[:, :32])
    sub = head.leading_rows(32)
    assert sub.out_features == 32 and sub.weight_bytes * 3 == head.weight_bytes
    stored = sub.parts[0].data
    assert stored.data_ptr() == head.parts[0].data.data_ptr()  # a view: no copy
    assert head.leading_rows(32) is sub  # built once
    with pytest.raises(ValueError, match="num_rows: 40 cuts a group of 16 rows of " + fmt):
        head.leading_rows(40)


def test_a_head_of_several_parts_is_cut_across_them():
    parts = [random_weight("q8_0", 32, IN_FEATURES, seed=5), random_weight("q4_1", 64, 128, 6)]
    head = QuantizedLinear(parts, bias=torch.randn(96))
    x = _x(2)
    with torch.inference_mode():
        full = head(x)
        for num_rows in (20, 32, 50, 96):
            assert torch.equal(leading_rows(head, x, num_rows), full[:, :num_rows])
    assert head.leading_rows(20).formats == ("q8_0",)
    assert head.leading_rows(50).formats == ("q8_0", "q4_1")
    for bad in (0, 97):
        with pytest.raises(ValueError, match=r"num_rows: must be in \[1, 96\]"):
            head.leading_rows(bad)


def test_leading_rows_are_views_that_follow_the_layer():
    # three parts, the first two of one format (one tensor in the layer): views, no copy
    parts = [random_weight("q8_0", 32, IN_FEATURES, seed=s) for s in (7, 8)]
    head = QuantizedLinear([*parts, random_weight("q4_1", 32, IN_FEATURES, 9)], torch.randn(96))
    sub = head.leading_rows(48)
    assert sub.formats == ("q8_0",)
    assert sub.parts[0].data.data_ptr() == head.parts[0].data.data_ptr()
    assert sub.bias.data_ptr() == head.bias.data_ptr()
    x = _x(2)
    with torch.inference_mode():
        head.bias.add_(1.0)  # an in-place update reaches the view
        assert torch.equal(leading_rows(head, x, 48), head(x)[:, :48])
    for num_rows in (16, 32, 64, 80):
        head.leading_rows(num_rows)
    assert list(head._leading) == [16, 32, 64, 80]  # the last four widths: 48 left
    head.bias = torch.zeros(96)  # new buffers: the views are dropped
    assert "_leading" not in head.__dict__


def test_plain_linear_slices_its_weight(monkeypatch):
    torch.manual_seed(0)
    head = nn.Linear(IN_FEATURES, 80, bias=True)
    x = _x(4, torch.float32)
    shapes = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(
        torch.nn.functional,
        "linear",
        lambda x, w, b=None: shapes.append(w.shape) or linear(x, w, b),
    )
    with torch.inference_mode():
        torch.testing.assert_close(leading_rows(head, x, 33), head(x)[:, :33], rtol=0, atol=1e-6)
    assert shapes == [(33, IN_FEATURES), (80, IN_FEATURES)]  # the first reads 33 rows only
    with pytest.raises(ValueError, match=r"num_rows: must be in \[1, 80\], got 81"):
        leading_rows(head, x, 81)


def test_a_hooked_head_computes_everything_and_slices():
    # A vocabulary-parallel head gathers its shards in a forward hook: the hook must run.
    head = nn.Linear(IN_FEATURES, 40, bias=False)
    assert reads_leading_rows(head, 2)
    head.register_forward_hook(lambda module, inputs, output: output * 2)
    assert not reads_leading_rows(head, 2)
    x = _x(2, torch.float32)
    with torch.inference_mode():
        assert torch.equal(leading_rows(head, x, 8), head(x)[:, :8])
        for bad in (0, -5, 41):
            with pytest.raises(ValueError, match=rf"num_rows: must be in \[1, 40\], got {bad}"):
                leading_rows(head, x, bad)


@pytest.mark.parametrize(
    "rows",
    # one row: the AVX512-BF16 GEMV; four: the AMX small-M GEMM, which only AMX CPUs run
    [1, pytest.param(4, marks=pytest.mark.kernel_variant("fused_small_gemm", "avx512_amx"))],
)
def test_prepacked_bf16_head_rows(rows):
    if not prepack.can_prepack(torch.bfloat16, "cpu", True):
        pytest.skip("no oneDNN bf16 packing in this PyTorch build")
    torch.manual_seed(0)
    linear = nn.Linear(IN_FEATURES, 64, bias=False).bfloat16()
    packed = prepack.PackedLinear(linear, shared_weight=True)
    x = _x(rows)
    assert reads_leading_rows(packed, rows) and not reads_leading_rows(packed, None)
    assert not reads_leading_rows(packed, prepack.SMALL_GEMM_MAX_ROWS + 1)
    with torch.inference_mode():
        full = packed(x)
        assert torch.equal(packed.leading_rows_forward(x, 32), full[:, :32])
        assert torch.equal(leading_rows(packed, x, 64), full)
    with pytest.raises(ValueError, match=r"num_rows: must be in \[1, 64\], got 0"):
        packed.leading_rows_forward(x, 0)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_model_logits_over_leading_ids(family):
    # gemma2 soft-caps its final logits: the cap applies to the leading columns alike.
    model = engine(tiny_checkpoint(family)).parts.model
    hidden = torch.randn(3, model.variant.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model.compute_logits(hidden)
        assert full.shape == (3, VOCAB) and full.dtype == torch.float32
        torch.testing.assert_close(model.compute_logits(hidden, 64), full[:, :64], rtol=0, atol=0)
        assert torch.equal(model.compute_logits(hidden, VOCAB), full)
        assert torch.equal(model.compute_logits(hidden, 10 * VOCAB), full)


def test_prepacked_bf16_head_without_its_kernels_computes_every_row():
    # Without the native kernels (native=False; or a CPU without them for that row count)
    # the head keeps no plain weight: every output is computed by oneDNN, then sliced.
    if not prepack.can_prepack(torch.bfloat16, "cpu", True):
        pytest.skip("no oneDNN bf16 packing in this PyTorch build")
    torch.manual_seed(0)
    linear = nn.Linear(IN_FEATURES, 64, bias=False).bfloat16()
    packed = prepack.PackedLinear(linear, shared_weight=True, native=False)
    x = _x(4)
    assert not reads_leading_rows(packed, 1) and not reads_leading_rows(packed, 4)
    with torch.inference_mode():
        assert torch.equal(packed.leading_rows_forward(x, 32), packed(x)[:, :32])
