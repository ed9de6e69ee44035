"""The fused window-score kernels (``csrc/window_fused_amx.h`` on AMX tiles,
``csrc/window_fused_bf16.h`` with AVX512-BF16 dot products, ``csrc/window_fused_fma.h`` with
fp32 FMAs): summed window attention and the window rows' log-sum-exps, dense and paged, against
an fp64 reference. Every case runs on each variant this CPU runs (forced through
``SPARSEKV_KERNEL_ISA``), in bf16 and, on the fp32-FMA variants (``avx2``, ``generic``), in
fp32 (within 1e-5 too); the others are deselected and named in the run's summary."""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.cpu import ops
from sparsekv.attention.cpu import window_fused as wf


@pytest.fixture(
    autouse=True,
    params=[
        pytest.param(v, marks=pytest.mark.kernel_variant("window_fused", v)) for v in wf.VARIANTS
    ],
)
def variant(request, monkeypatch) -> str:
    monkeypatch.setenv(ops.ISA_ENV, request.param)
    assert wf.window_fused_isa() == request.param
    return request.param


def dtypes(variant: str) -> tuple[torch.dtype, ...]:
    """The input dtypes variant ``variant`` takes."""
    return (torch.bfloat16, torch.float32) if variant in wf.FP32_VARIANTS else (torch.bfloat16,)


def reference(queries, keys, scale, lse=None):
    """fp64 ``(scores [H, n], lse [H, w])`` of the causal window definition."""
    num_heads, w, _ = queries.shape
    num_kv_heads, n, _ = keys.shape
    expanded = keys.double().repeat_interleave(num_heads // num_kv_heads, 0)
    logits = torch.einsum("hid,hjd->hij", queries.double(), expanded) * scale
    visible = torch.arange(n)[None, :] <= (n - w + torch.arange(w))[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, -1) if lse is None else lse.double()
    return torch.exp(logits - lse[..., None]).sum(1), lse


def random_case(num_kv_heads, group, w, n, head_dim, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    queries = (2 * torch.randn(num_kv_heads * group, w, head_dim, generator=g)).to(dtype)
    keys = torch.randn(num_kv_heads, n, head_dim, generator=g).to(dtype)
    return queries, keys


SHAPES = [  # (num_kv_heads, group, w, n, head_dim)
    (3, 3, 32, 1040, 64),
    (2, 4, 8, 37, 64),
    (1, 1, 1, 1, 32),
    (4, 1, 5, 5, 64),
    (5, 3, 7, 100, 128),
    (2, 2, 16, 300, 256),
    (84, 3, 32, 130, 64),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dense_matches_fp64_reference(variant, shape, dtype):
    if dtype not in dtypes(variant):  # a bf16-only variant: fp32 is refused
        with pytest.raises(RuntimeError, match="bfloat16 only"):
            wf.window_scores_fused(*random_case(1, 1, 1, 1, 32, 0, dtype), None, 1.0, variant)
        return
    queries, keys = random_case(*shape, seed=sum(shape), dtype=dtype)
    scale = shape[-1] ** -0.5
    scores, lse = wf.window_scores_fused(queries, keys, None, scale)
    expected, expected_lse = reference(queries, keys, scale)
    assert scores.dtype == lse.dtype == torch.float32
    assert scores.shape == expected.shape and lse.shape == expected_lse.shape
    torch.testing.assert_close(lse.double(), expected_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(scores.double(), expected, rtol=0, atol=1e-5 * expected.max().item())
    # With the LSE given, it is used as given (here: shifted by log 2 -> scores halve).
    given = (expected_lse + torch.log(torch.tensor(2.0, dtype=torch.float64))).float()
    halved, returned = wf.window_scores_fused(queries, keys, given.contiguous(), scale)
    torch.testing.assert_close(
        halved.double(), expected / 2, rtol=0, atol=1e-5 * expected.max().item()
    )
    assert torch.equal(returned, given)


@pytest.mark.parametrize("magnitude", [1e5, 1e9])
def test_huge_logits_stay_finite(variant, magnitude):
    # Queries scaled by `magnitude`: the terms are taken against each row's max before the
    # scale, so the max key's term is exactly 1 (a fused logit * scale - max was off by up to
    # half a unit in the max's last place: NaN rows near 1e9).
    queries, keys = random_case(3, 3, 32, 300, 64, seed=11)
    queries = (queries.float() * magnitude).bfloat16()
    scores, lse = wf.window_scores_fused(queries, keys, None, 0.125)
    expected, expected_lse = reference(queries, keys, 0.125)
    torch.testing.assert_close(scores.double(), expected, rtol=0, atol=1e-5 * 32)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-6, atol=0)
    # A given fp32 lse of this size is only known to 1e-7 relative: the terms stay finite and
    # at most 1 (as exp(logit - lse) is), so every head's scores sum to at most w.
    given, _ = wf.window_scores_fused(queries, keys, expected_lse.float(), 0.125)
    assert given.isfinite().all() and (given.sum(1) <= 32).all()


def test_a_given_lse_below_the_logits_caps_their_terms_at_one(variant):
    # exp(logit - lse) <= 1 for a row's own lse; an lse 1 below it (as the lse of other logits
    # can be) leaves every term e times larger, and the kernel caps those above 1.
    queries, keys = random_case(2, 3, 8, 60, 64, seed=5)
    _, exact_lse = reference(queries, keys, 0.125)
    low = (exact_lse - 1.0).float()
    scores, _ = wf.window_scores_fused(queries, keys, low, 0.125)
    expanded = keys.double().repeat_interleave(3, 0)
    logits = torch.einsum("hid,hjd->hij", queries.double(), expanded) * 0.125
    visible = torch.arange(60)[None, :] <= (60 - 8 + torch.arange(8))[:, None]
    terms = torch.exp(logits - low.double()[..., None]).clamp(max=1.0).masked_fill(~visible, 0)
    assert (torch.exp(logits - low.double()[..., None]) > 1).any()  # the cap does apply here
    torch.testing.assert_close(scores.double(), terms.sum(1), rtol=1e-5, atol=1e-6)


def test_a_nan_row_stays_in_its_head(variant):
    # Group 3, w = 7: heads share 16-row blocks. One NaN query element makes its head's scores
    # NaN (its lse is NaN); the other heads' scores are untouched.
    queries, keys = random_case(2, 3, 7, 100, 64, seed=9)
    clean, _ = wf.window_scores_fused(queries, keys, None, 0.125)
    queries[1, 3, 5] = float("nan")
    scores, lse = wf.window_scores_fused(queries, keys, None, 0.125)
    assert lse[1].isnan().any() and scores[1].isnan().any()
    others = [0, 2, 3, 4, 5]
    assert torch.equal(scores[others], clean[others])


def test_rows_sum_to_one_and_strided_keys(variant):
    for dtype in dtypes(variant):
        queries, keys = random_case(3, 3, 32, 500, 64, seed=7, dtype=dtype)
        wide = torch.zeros(3, 600, 64, dtype=dtype)
        wide[:, :500] = keys
        strided = wide[:, :500]  # row stride 64, head stride 600 * 64
        scores, _ = wf.window_scores_fused(queries, strided, None, 0.125)
        dense, _ = wf.window_scores_fused(queries, keys, None, 0.125)
        assert torch.equal(scores, dense)
        # Every row's probabilities sum to 1, so each head's scores sum to w.
        torch.testing.assert_close(scores.sum(1), torch.full((9,), 32.0), rtol=1e-5, atol=0)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("n", [1, 16, 45, 1040])
def test_paged_equals_dense_over_the_same_keys(variant, block_size, n):
    for dtype in dtypes(variant):
        paged_equals_dense(block_size, n, dtype)


def paged_equals_dense(block_size, n, dtype):
    num_layers, num_kv_heads, group, head_dim = 3, 3, 3, 64
    w = min(n, 32)
    g = torch.Generator().manual_seed(n + block_size)
    num_blocks = -(-n // block_size)
    pool = torch.randn(
        num_layers * num_blocks + 5, 2, num_kv_heads, block_size, head_dim, generator=g
    )
    pool = pool.to(dtype)
    tables = torch.randperm(pool.shape[0], generator=g)[: num_layers * num_blocks]
    tables = tables.view(num_layers, num_blocks).contiguous()
    queries = (2 * torch.randn(num_layers * num_kv_heads * group, w, head_dim, generator=g)).to(
        dtype
    )
    scores, lse = wf.window_scores_fused_paged(queries, pool, tables, n, None, head_dim**-0.5)
    keys = pool[tables, 0].permute(0, 2, 1, 3, 4).reshape(num_layers * num_kv_heads, -1, head_dim)
    dense, dense_lse = wf.window_scores_fused(queries, keys[:, :n], None, head_dim**-0.5)
    assert torch.equal(scores, dense) and torch.equal(lse, dense_lse)


def test_bad_arguments_raise():
    queries, keys = random_case(1, 3, 8, 20, 64, seed=1)
    with pytest.raises(RuntimeError, match="window"):
        wf.window_scores_fused(queries, keys[:, :4], None, 0.1)  # w > n
    with pytest.raises(RuntimeError, match="bfloat16|dtype"):  # mixed bf16 and fp32
        wf.window_scores_fused(queries.float(), keys, None, 0.1)
    with pytest.raises(RuntimeError, match="lse"):
        wf.window_scores_fused(queries, keys, torch.zeros(3, 7), 0.1)
    pool = torch.zeros(4, 2, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        wf.window_scores_fused_paged(
            queries, pool, torch.zeros(1, 3, dtype=torch.long), 20, None, 0.1
        )
    pool = torch.zeros(4, 2, 1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of range"):
        wf.window_scores_fused_paged(queries, pool, torch.tensor([[0, 9]]), 20, None, 0.1)
    # The rows' references are subtracted before the scale: it must be positive and finite.
    for scale in (0.0, -0.125, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            wf.window_scores_fused(queries, keys, None, scale)
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            wf.window_scores_fused_paged(queries, pool, torch.tensor([[0, 1]]), 20, None, scale)


def test_support_check(variant, monkeypatch):
    pool = torch.zeros(2, 2, 1, 16, 64, dtype=torch.bfloat16)
    queries = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    assert wf.supports_window_fused(queries, pool)
    fp32 = variant in wf.FP32_VARIANTS
    assert wf.supports_window_fused(queries.float(), pool.float()) == fp32
    assert wf.window_fused_isa(torch.float32) == (variant if fp32 else None)
    assert not wf.supports_window_fused(queries.float(), pool)  # mixed dtypes
    assert not wf.supports_window_fused(queries.half(), pool.half())
    assert not wf.supports_window_fused(queries, torch.zeros(2, 2, 1, 8, 64, dtype=torch.bfloat16))
    monkeypatch.setenv(ops.ISA_ENV, "avx512")
    assert not wf.supports_window_fused(queries, pool)
