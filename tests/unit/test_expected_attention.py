"""Expected Attention against a brute-force float64 reference built the paper's way.

The reference draws pre-RoPE queries at absolute positions, rotates them with explicit RoPE
matrices (what the engine hands the compressor), and scores in the pre-RoPE frame: mean and
covariance of the raw queries, the explicit rotation matrices of the next ``n_future`` absolute
positions averaged, the Gaussian moment-generating exponent per key in a loop, softmax,
group mean, value norm, sinks kept. The compressor sees only post-RoPE queries and the
frequencies, so this also checks its relative-position frame. Kept sets are compared with
ties going to the newer slot.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv.compression import LayerView, get_compressor
from sparsekv.compression.expected_attention import ExpectedAttentionCompressor
from sparsekv.config import CompressionConfig
from tests.unit.test_compression import ref_keep

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5


def rope_matrix(position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Explicit ``[HEAD_DIM, HEAD_DIM]`` float64 RoPE rotation (rotate-half layout)."""
    half = inv_freq.shape[0]
    matrix = torch.eye(HEAD_DIM, dtype=torch.float64)
    for k in range(half):
        angle = position * float(inv_freq[k])
        matrix[k, k] = math.cos(angle)
        matrix[k, k + half] = -math.sin(angle)
        matrix[k + half, k] = math.sin(angle)
        matrix[k + half, k + half] = math.cos(angle)
    return matrix


def make_case(num_kv_heads, group, n, w, first_position, inv_freq, seed=0):
    """Keys, values, pre-RoPE window queries and their post-RoPE form."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_kv_heads, n, HEAD_DIM, generator=gen, dtype=torch.float64)
    values = torch.rand(num_kv_heads, n, HEAD_DIM, generator=gen, dtype=torch.float64) + 0.1
    pre = torch.randn(num_kv_heads * group, w, HEAD_DIM, generator=gen, dtype=torch.float64)
    pre = pre + torch.randn(1, 1, HEAD_DIM, generator=gen, dtype=torch.float64)  # non-zero mean
    post = pre.clone()
    if inv_freq is not None:
        for i in range(w):
            post[:, i] = pre[:, i] @ rope_matrix(first_position + i, inv_freq).T
    return keys, values, pre, post


def reference_scores(keys, values, pre, last_position, inv_freq, n_future, sinks, gqa_agg):
    """``[num_kv_heads, n]`` float64 Expected Attention scores, sinks ``+inf``."""
    num_kv_heads, n, _ = keys.shape
    num_heads, w, _ = pre.shape
    group = num_heads // num_kv_heads
    average = torch.zeros(HEAD_DIM, HEAD_DIM, dtype=torch.float64)
    if inv_freq is None:
        average = torch.eye(HEAD_DIM, dtype=torch.float64)
    else:
        for t in range(last_position + 1, last_position + n_future + 1):
            average += rope_matrix(t, inv_freq) / n_future
    per_head = torch.zeros(num_heads, n - sinks, dtype=torch.float64)
    for h in range(num_heads):
        mean = pre[h].mean(0)
        cov = sum(torch.outer(q - mean, q - mean) for q in pre[h]) / w
        mean_f, cov_f = average @ mean, average @ cov @ average.T
        exponents = [
            SCALE * float(mean_f @ keys[h // group, j])
            + 0.5 * SCALE**2 * float(keys[h // group, j] @ cov_f @ keys[h // group, j])
            for j in range(sinks, n)
        ]
        per_head[h] = torch.softmax(torch.tensor(exponents, dtype=torch.float64), dim=0)
    grouped = per_head.view(num_kv_heads, group, n - sinks)
    scores = grouped.amax(1) if gqa_agg == "max" else grouped.mean(1)
    scores = scores * values[:, sinks:].norm(dim=-1)
    return torch.cat([torch.full((num_kv_heads, sinks), math.inf, dtype=torch.float64), scores], 1)


CASES = [
    # num_kv_heads, group, n, w, inv_freq (None: no RoPE), gqa_agg
    (2, 3, 60, 8, torch.tensor([1.0, 0.1, 0.01, 0.001]), "mean"),  # full rotary
    (1, 4, 45, 16, torch.tensor([0.5, 0.05]), "max"),  # partial rotary (4 of 8 dims)
    (3, 1, 50, 5, None, "mean"),
]


@pytest.mark.parametrize("num_kv_heads,group,n,w,inv_freq,gqa_agg", CASES)
@pytest.mark.parametrize("n_future", [1, 64])
def test_kept_indices_equal_the_dense_reference(num_kv_heads, group, n, w, inv_freq, gqa_agg,
                                                n_future):  # fmt: skip
    first = 300 + n - w  # the window's absolute positions: a prefix cache sat before the slots
    keys, values, pre, post = make_case(num_kv_heads, group, n, w, first, inv_freq, seed=n)
    view = LayerView(keys.float(), values.float(), post.float(), None, SCALE,
                     rope_inv_freq=inv_freq)  # fmt: skip
    compressor = ExpectedAttentionCompressor(window=w, gqa_agg=gqa_agg, n_future=n_future)
    scores = compressor.score(view)
    expected = reference_scores(keys, values, pre, first + w - 1, inv_freq, n_future, 4, gqa_agg)
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-7)
    for budget in (w + 6, n // 2, n - 1):
        kept = compressor.select(view, budget, w)
        assert kept.shape == (num_kv_heads, budget)
        for head in range(num_kv_heads):
            assert kept[head].tolist() == ref_keep(expected[head], n, budget, w), (budget, head)


def test_equal_scores_keep_the_sinks_and_the_newest_slots():
    keys = torch.ones(1, 40, HEAD_DIM)
    queries = torch.randn(2, 4, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    view = LayerView(keys, keys.clone(), queries, None, SCALE, rope_inv_freq=torch.ones(4))
    kept = ExpectedAttentionCompressor(window=4).select(view, 14, 4)
    assert kept.tolist() == [[0, 1, 2, 3] + list(range(30, 40))]


def test_a_single_window_query_has_no_covariance_term():
    keys, values, pre, post = make_case(1, 2, 30, 1, 29, None, seed=3)
    view = LayerView(keys.float(), values.float(), post.float(), None, SCALE)
    with_cov = ExpectedAttentionCompressor(window=1).score(view)
    without = ExpectedAttentionCompressor(window=1, use_covariance=False).score(view)
    torch.testing.assert_close(with_cov, without)


def test_registry_builds_it_from_a_policy():
    config = CompressionConfig(method="expected_attention", window=16, gqa_agg="max")
    compressor = get_compressor(config)
    assert compressor == ExpectedAttentionCompressor(window=16, gqa_agg="max")
    assert (compressor.n_future, compressor.sinks, compressor.stackable) == (512, 4, False)
