"""Window scores on the native kernel (``compression.scoring.window_attention_scores``) equal the
dense fp32 definition (``attention_mass_per_head``), with the log-sum-exps given (prefill: from
the attention) or computed (decode-time re-scoring: unmasked flash over the slots every window
row sees, exact logits for the causal corner).

Tolerances: relative to the largest score; fp32 inputs 1e-5 (measured <= 9e-7), bf16 inputs
1e-4 (the reference upcasts the same bf16 values; measured <= 4.4e-5 with computed lse).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.backends import cpu_window
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import build
from sparsekv.compression import scoring
from sparsekv.compression.base import LayerView
from sparsekv.compression.snapkv import SnapKVCompressor

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
SCALE = 0.125

pytestmark = pytest.mark.kernel_variant("decode")


@pytest.fixture(autouse=True, scope="module")
def _native_built() -> None:
    assert build.load_extension() is not None, "the native extension failed to build"


NATIVE = CpuNativeBackend()


def _inputs(num_kv_heads, group, n, w, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_kv_heads, n, head_dim, generator=generator).to(dtype)
    queries = 2 * torch.randn(num_kv_heads * group, w, head_dim, generator=generator)
    return keys, queries.to(dtype)


def _dense_lse(keys, queries, scale):
    group = queries.shape[0] // keys.shape[0]
    logits = queries.float() @ keys.float().repeat_interleave(group, 0).transpose(1, 2) * scale
    w, n = queries.shape[1], keys.shape[1]
    visible = torch.arange(n)[None, :] <= torch.arange(w)[:, None] + (n - w)
    return torch.logsumexp(logits.masked_fill(~visible, float("-inf")), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("given_lse", [False, True], ids=["lse-computed", "lse-given"])
@pytest.mark.parametrize(
    "num_kv_heads,group,n,w,head_dim",
    [
        (3, 3, 1040, 32, 64),  # SmolLM2 layer at decode-time re-scoring
        (12, 3, 300, 32, 64),  # several layers stacked into one view
        (2, 1, 37, 5, 64),  # no GQA, page-unaligned
        (1, 4, 16, 16, 128),  # window = every slot (no unmasked head part)
        (1, 2, 17, 1, 256),  # one row (TOVA), one slot past a page
    ],
)
def test_native_window_scores_equal_dense(num_kv_heads, group, n, w, head_dim, dtype, given_lse):
    keys, queries = _inputs(num_kv_heads, group, n, w, head_dim, dtype)
    lse = _dense_lse(keys, queries, SCALE) if given_lse else None
    assert cpu_window.native_window_ready(keys, queries)
    got = scoring.window_attention_scores(keys, queries, lse, SCALE, backend=NATIVE)
    want = scoring.attention_mass_per_head(keys, queries, lse, SCALE)
    assert got.dtype == torch.float32 and got.shape == (num_kv_heads * group, n)
    torch.testing.assert_close(got, want, rtol=0, atol=REL_TOL[dtype] * want.abs().max().item())
    # Rows of a window sum to 1 over the slots they see: total mass = window rows per head.
    torch.testing.assert_close(
        got.sum(dim=1), torch.full((got.shape[0],), float(w)), rtol=1e-4, atol=0
    )


def test_snapkv_keeps_the_same_slots_native_and_dense(monkeypatch):
    """A SmolLM2-sized decode re-scoring picks the identical kept set on both paths (fp32)."""
    keys, queries = _inputs(3, 3, 1040, 32, 64, torch.float32, seed=3)
    view = LayerView(
        keys=keys, values=keys, window_queries=queries, window_lse=None, scale=SCALE, backend=NATIVE
    )
    native_kept = SnapKVCompressor().select(view, 1024, 32)
    monkeypatch.setenv("SPARSEKV_DISABLE_NATIVE", "1")
    assert not cpu_window.native_window_ready(keys, queries)
    dense_kept = SnapKVCompressor().select(view, 1024, 32)
    assert torch.equal(native_kept, dense_kept)


def test_fallback_when_dtypes_differ():
    keys, queries = _inputs(1, 2, 40, 8, 64, torch.float32)
    assert not cpu_window.native_window_ready(keys, queries.bfloat16())
    got = scoring.window_attention_scores(keys, queries.bfloat16(), None, SCALE, backend=NATIVE)
    want = scoring.attention_mass_per_head(keys, queries.bfloat16(), None, SCALE)
    torch.testing.assert_close(got, want)
