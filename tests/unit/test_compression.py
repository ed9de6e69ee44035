"""Compressors against a brute-force float64 reference (each method as its paper defines it;
top-k ties go to the newer slot).

The reference builds the full causal softmax matrix, computes each method's scores with plain
formulas and loops, and picks the kept set by sorting on (score, index) so ties go to the more
recent slot; ``select`` must return exactly that set per KV head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.compression import (
    COMPRESSORS,
    Compressor,
    LayerView,
    attention_mass_per_head,
    get_compressor,
    prefill_attention_mass,
    window_attention_scores,
)
from sparsekv.compression.base import kept_indices_prefer_recent, top_indices_prefer_recent
from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.config import COMPRESSION_METHODS, CompressionConfig

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: intra-op threads only add overhead (3x on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_qk(num_kv_heads: int, group: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_kv_heads, n, HEAD_DIM, generator=gen)
    queries = torch.randn(num_kv_heads * group, n, HEAD_DIM, generator=gen) * 2.0
    return keys, queries


def brute_attention(keys, queries):
    """Full causal softmax ``[num_heads, n, n]`` and LSE ``[num_heads, n]`` in float64."""
    group = queries.shape[0] // keys.shape[0]
    n = keys.shape[1]
    logits = queries.double() @ keys.double().repeat_interleave(group, 0).transpose(1, 2) * SCALE
    logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse[..., None]), lse


def ref_pool(scores, pooling, kernel):
    """Loop pooling with kvpress semantics (avg divides by the kernel, pads count as zero)."""
    if pooling == "none" or kernel == 1:
        return scores
    out = torch.empty_like(scores)
    half = kernel // 2
    for j in range(scores.shape[1]):
        seg = scores[:, max(0, j - half) : j + half + 1]
        out[:, j] = seg.amax(1) if pooling == "max" else seg.sum(1) / kernel
    return out


def ref_group(scores, num_kv_heads, how):
    group = scores.shape[0] // num_kv_heads
    out = []
    for g in range(num_kv_heads):
        members = scores[g * group : (g + 1) * group]
        out.append(members.amax(0) if how == "max" else members.sum(0) / group)
    return torch.stack(out)


def ref_keep(scores_row, n, budget, num_recent):
    """Kept slots: all if n <= budget, else the recent ones plus the best older, ties -> recent."""
    if n <= budget:
        return list(range(n))
    num_recent = min(num_recent, budget)
    older = sorted(range(n - num_recent), key=lambda j: (-float(scores_row[j]), -j))
    return sorted(older[: budget - num_recent] + list(range(n - num_recent, n)))


def assert_selects(compressor, view, budget, window, ref_scores, num_recent):
    kept = compressor.select(view, budget, window)
    n = view.num_tokens
    assert kept.dtype == torch.int64
    assert kept.shape == (view.num_kv_heads, min(budget, n))
    for head in range(view.num_kv_heads):
        expected = ref_keep(ref_scores[head], n, budget, num_recent)
        assert kept[head].tolist() == expected, f"head {head}"


def ref_snapkv(attn, num_kv_heads, window, pooling, kernel, how):
    n = attn.shape[-1]
    prefix = attn[:, n - window :, : n - window].sum(1) / window
    return ref_group(ref_pool(prefix, pooling, kernel), num_kv_heads, how)


def view_of(keys, queries, window, lse=None, **kw):
    wlse = None if lse is None else lse[:, -window:].float()
    return LayerView(keys, keys.clone(), queries[:, -window:], wlse, SCALE, **kw)


# --- shared scoring helpers -------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [1, 8, 32])
def test_window_attention_scores_match_softmax_rows(group, window):
    keys, queries = make_qk(2, group, 70)
    attn, lse = brute_attention(keys, queries)
    expected = attn[:, -window:].sum(1)
    given = window_attention_scores(keys, queries[:, -window:], lse[:, -window:].float(), SCALE)
    computed = window_attention_scores(keys, queries[:, -window:], None, SCALE)
    assert given.dtype == torch.float32 and given.shape == (2 * group, 70)
    torch.testing.assert_close(given.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(computed.double(), expected, rtol=1e-5, atol=1e-6)


def test_window_lse_is_used_as_given():
    keys, queries = make_qk(2, 3, 40)
    _, lse = brute_attention(keys, queries)
    true = window_attention_scores(keys, queries[:, -8:], lse[:, -8:].float(), SCALE)
    shifted = window_attention_scores(
        keys, queries[:, -8:], lse[:, -8:].float() + math.log(2), SCALE
    )
    torch.testing.assert_close(shifted * 2, true)


@pytest.mark.parametrize("num_queries", [1, 17, 90])
def test_prefill_attention_mass_is_column_sums(num_queries):
    keys, queries = make_qk(2, 3, 90)
    attn, lse = brute_attention(keys, queries)
    expected = attn[:, -num_queries:].sum(1).reshape(2, 3, 90).sum(1)
    q, q_lse = queries[:, -num_queries:], lse[:, -num_queries:].float()
    mass = prefill_attention_mass(keys, q, q_lse, SCALE)
    assert mass.shape == (2, 90) and mass.dtype == torch.float32
    torch.testing.assert_close(mass.double(), expected, rtol=1e-5, atol=1e-5)
    # Tiny chunks (1-3 query rows at a time) give the same sums, with and without the LSE.
    for lse_arg in (q_lse, None):
        chunked = attention_mass_per_head(keys, q, lse_arg, SCALE, max_chunk_elements=6 * 90 * 3)
        per_kv_head = chunked.reshape(2, 3, 90).sum(1).double()
        torch.testing.assert_close(per_kv_head, expected, rtol=1e-5, atol=1e-5)


# --- select mechanics -------------------------------------------------------------------------


@dataclass
class FixedScores(Compressor):
    scores: torch.Tensor | None = None
    recent: int | None = None

    def score(self, view):
        return self.scores

    def num_recent(self, budget, window):
        return window if self.recent is None else self.recent


@pytest.mark.parametrize("budget", [5, 20, 49, 50, 80])
@pytest.mark.parametrize("recent", [None, 1, 10])
def test_select_ties_go_to_recent(budget, recent):
    gen = torch.Generator().manual_seed(budget)
    scores = torch.randint(0, 3, (2, 50), generator=gen).float()  # many exact ties
    keys = torch.zeros(2, 50, HEAD_DIM)
    view = LayerView(keys, keys, torch.zeros(4, 4, HEAD_DIM), None, SCALE)
    compressor = FixedScores(scores=scores, recent=recent)
    assert_selects(compressor, view, budget, 4, scores, 4 if recent is None else recent)


@pytest.mark.parametrize("backend", [CpuNativeBackend(), TorchBackend()], ids=["cpu", "torch"])
@pytest.mark.parametrize("m", [1, 7, 50, 1008])
@pytest.mark.parametrize("values", ["distinct", "ties", "two", "inf", "signed_zero", "nan"])
def test_kept_indices_equal_the_sorted_top_indices(m, values, backend):
    """The sort-free selection (the native backend's C++ operator, or the torch ops of
    ``attention.selection``) keeps exactly the slots of the stable-sort ranking (ties to the
    recent slot), in ascending order, for every ``k``-class and tie pattern."""
    gen = torch.Generator().manual_seed(m)
    scores = torch.rand(5, m, generator=gen)
    if values == "ties":
        scores = (scores * 8).floor()
    elif values == "two":
        scores = (scores * 2).floor()
    elif values == "inf":
        scores[scores < 0.2], scores[scores > 0.9] = float("inf"), float("-inf")
    elif values == "signed_zero":
        scores[scores < 0.5], scores[scores > 0.8] = 0.0, -0.0
    elif values == "nan":
        scores[scores < 0.1] = float("nan")
    for k in sorted({0, 1, m // 2, max(0, m - 16), m - 1, m}):
        expected = top_indices_prefer_recent(scores, k).sort(dim=-1).values
        assert torch.equal(backend.kept_indices(scores, k), expected), k
        if isinstance(backend, TorchBackend) and not isinstance(backend, CpuNativeBackend):
            assert torch.equal(kept_indices_prefer_recent(scores, k), expected), k


def test_select_keeps_all_when_prompt_fits():
    keys, queries = make_qk(2, 3, 30)
    kept = SnapKVCompressor().select(view_of(keys, queries, 8), 30, 8)
    assert kept.tolist() == [list(range(30))] * 2


def test_snapkv_constant_keys_tie_to_recent():
    # Small integers: every query-key product sum is exact in fp32 whatever order the GEMM
    # accumulates in, so the scores of equal keys tie exactly (random floats tie only up to
    # rounding, about one input in fourteen differs in the last bit).
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(-2, 3, (1, 1, HEAD_DIM), generator=gen).float()
    keys = keys.expand(2, 60, HEAD_DIM).contiguous()
    queries = torch.randint(-2, 3, (6, 60, HEAD_DIM), generator=gen).float() / 8
    kept = SnapKVCompressor(pooling="max", kernel_size=7).select(view_of(keys, queries, 8), 20, 8)
    assert kept.tolist() == [list(range(40, 60))] * 2


# --- methods vs the brute-force reference -----------------------------------------------------


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [1, 8, 32])
@pytest.mark.parametrize(
    "pooling,kernel", [("max", 1), ("max", 5), ("max", 7), ("avg", 5), ("avg", 7), ("none", 7)]
)
@pytest.mark.parametrize("gqa_agg", ["mean", "max"])
def test_snapkv_matches_reference(group, window, pooling, kernel, gqa_agg, method="snapkv"):
    n = 96
    keys, queries = make_qk(2, group, n, seed=window * 7 + kernel)
    attn, lse = brute_attention(keys, queries)
    config = CompressionConfig(
        method=method, window=window, pooling=pooling, kernel_size=kernel, gqa_agg=gqa_agg
    )
    compressor = get_compressor(config)
    ref = ref_snapkv(attn, 2, window, pooling, kernel, gqa_agg)
    view = view_of(keys, queries, window, lse)
    scores = compressor.score(view)
    torch.testing.assert_close(scores[:, : n - window].double(), ref, rtol=1e-5, atol=1e-7)
    assert torch.isinf(scores[:, n - window :]).all()
    for budget in (window + 1, n // 2, n - 1, n, n + 5):
        assert_selects(compressor, view, budget, window, ref, window)


def test_pyramidkv_scores_like_snapkv():
    test_snapkv_matches_reference(3, 8, "max", 7, "mean", method="pyramidkv")


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("gqa_agg", ["mean", "max"])
@pytest.mark.parametrize("window", [1, 8])
def test_tova_matches_reference(group, gqa_agg, window):
    n = 80
    keys, queries = make_qk(2, group, n, seed=3)
    attn, lse = brute_attention(keys, queries)
    ref = ref_group(attn[:, -1], 2, gqa_agg)
    compressor = get_compressor(CompressionConfig(method="tova", window=window, gqa_agg=gqa_agg))
    for view in (view_of(keys, queries, window, lse), view_of(keys, queries, window)):
        torch.testing.assert_close(compressor.score(view).double(), ref, rtol=1e-5, atol=1e-7)
        for budget in (window + 1, 40, n):
            assert_selects(compressor, view, budget, window, ref, window)


@pytest.mark.parametrize("window", [1, 8, 32])
def test_h2o_keeps_heavy_hitters_and_recent_half(window):
    n = 100
    keys, queries = make_qk(2, 3, n, seed=5)
    attn, lse = brute_attention(keys, queries)
    accumulated = prefill_attention_mass(keys, queries, lse.float(), SCALE)
    ref = attn.sum(1).reshape(2, 3, n).sum(1)
    torch.testing.assert_close(accumulated.double(), ref, rtol=1e-5, atol=1e-5)
    compressor = get_compressor(CompressionConfig(method="h2o", window=window))
    view = view_of(keys, queries, window, lse, accumulated=accumulated)
    for budget in (window + 1, 40, 80, n):
        assert_selects(compressor, view, budget, window, accumulated, max(budget // 2, window))
    with pytest.raises(ValueError, match="accumulated"):
        compressor.select(view_of(keys, queries, window), 50, window)


@pytest.mark.parametrize("budget,window", [(20, 8), (40, 32), (12, 1)])
def test_streaming_llm_keeps_sinks_and_recent(budget, window):
    keys, queries = make_qk(2, 3, 100)
    compressor = get_compressor(CompressionConfig(method="streaming_llm", window=window))
    kept = compressor.select(view_of(keys, queries, window), budget, window)
    expected = [0, 1, 2, 3] + list(range(100 - (budget - 4), 100))
    assert kept.tolist() == [expected] * 2


def test_knorm_keeps_smallest_norm_keys():
    keys, queries = make_qk(2, 3, 60, seed=9)
    keys[:, [10, 30, 45]] = keys[:, :1] * 0.01  # three equal smallest norms: ties -> recent
    compressor = get_compressor(CompressionConfig(method="knorm", window=8))
    view = view_of(keys, queries, 8)
    ref = -keys.double().norm(dim=-1)
    for budget in (10, 9 + 8, 30):
        assert_selects(compressor, view, budget, 8, ref, 8)
    assert compressor.select(view, 10, 8)[:, :2].tolist() == [[30, 45]] * 2


def test_random_is_seeded_and_reproducible():
    keys, queries = make_qk(2, 3, 200)
    compressor = get_compressor(CompressionConfig(method="random", window=8))

    def kept(seed):
        gen = torch.Generator().manual_seed(seed)
        return compressor.select(view_of(keys, queries, 8, generator=gen), 50, 8)

    assert torch.equal(kept(1), kept(1))
    assert not torch.equal(kept(1), kept(2))
    assert kept(1)[:, -8:].tolist() == [list(range(192, 200))] * 2


# --- kvpress reproduction ---------------------------------------------------------------------


def kvpress_snapkv_scores(keys, queries, window, kernel):
    """kvpress SnapKVPress.score written independently from its published formula."""
    num_kv_heads, n, d = keys.shape
    group = queries.shape[0] // num_kv_heads
    weights = queries[:, -window:] @ keys.repeat_interleave(group, 0).transpose(1, 2) / math.sqrt(d)
    mask = torch.triu(torch.full_like(weights, float("-inf")), diagonal=n - window + 1)
    weights = torch.softmax(weights + mask, dim=-1, dtype=torch.float32)[..., :-window]
    scores = F.avg_pool1d(weights.mean(dim=-2)[None], kernel, padding=kernel // 2, stride=1)[0]
    return scores.view(num_kv_heads, group, n - window).mean(1)


@pytest.mark.parametrize("group", [1, 3])
def test_snapkv_reproduces_kvpress(group):
    n, window = 300, 64
    keys, queries = make_qk(2, group, n, seed=11)
    expected = kvpress_snapkv_scores(keys, queries, window, 5)
    config = CompressionConfig(method="snapkv", window=window, pooling="avg", kernel_size=5)
    compressor = get_compressor(config)
    view = view_of(keys, queries, window)
    torch.testing.assert_close(compressor.score(view)[:, : n - window], expected)
    for budget in (100, 150):
        top = expected.topk(budget - window, dim=-1).indices
        ref = torch.cat([top, torch.arange(n - window, n).expand(2, window)], 1).sort(1).values
        assert torch.equal(compressor.select(view, budget, window), ref)


# --- registry ---------------------------------------------------------------------------------


def test_registry_covers_every_method():
    assert set(COMPRESSORS) == set(COMPRESSION_METHODS) - {"none"}
    assert get_compressor(CompressionConfig(method="none")) is None
    assert get_compressor(CompressionConfig(budget=None, compression_ratio=0.0)) is None
    config = CompressionConfig(window=16, pooling="avg", kernel_size=5, gqa_agg="max")
    assert get_compressor(config) == SnapKVCompressor(16, "avg", 5, "max")
    for name, cls in COMPRESSORS.items():
        assert isinstance(get_compressor(CompressionConfig(method=name)), cls)
    with pytest.raises(ValueError, match="method"):
        get_compressor(CompressionConfig(method="bogus"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", sorted(COMPRESSORS))
def test_every_method_obeys_the_select_contract(method, dtype):
    keys, queries = make_qk(2, 3, 120, seed=13)
    keys, queries = keys.to(dtype), queries.to(dtype)
    accumulated = prefill_attention_mass(keys, queries, None, SCALE)
    view = view_of(keys, queries, 16, accumulated=accumulated, generator=torch.Generator())
    compressor = get_compressor(CompressionConfig(method=method, window=16))
    scores = compressor.score(view)
    assert scores.dtype == torch.float32 and scores.shape == (2, 120)
    kept = compressor.select(view, 50, 16)
    assert kept.dtype == torch.int64 and kept.shape == (2, 50)
    for row in kept.tolist():
        assert row == sorted(set(row)) and row[-16:] == list(range(104, 120))
