"""The ``avx512_bf16`` decode kernel's own contract: bf16 pages on vdpbf16ps dot products.

Its logits multiply the raw bf16 query by the keys exactly (the scale multiplies the fp32 sums),
so its log-sum-exp is as close to the fp32 reference as the vector kernel's; its value product
takes the probabilities rounded to bf16 (as the AMX kernel and bf16 flash attention do): against
a reference that rounds them the same way, only the output's own bf16 rounding remains. The every-variant checks against
``torch_ref`` (``test_kernels.py``) run it too.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.cpu import ops
from tests.unit.test_kernels import make_paged, reference_decode

pytestmark = pytest.mark.kernel_variant("decode", "avx512_bf16")


def _rounded_probability_reference(query, pool, tables, lens, scale):
    """fp32 attention whose value product takes bf16-rounded probabilities (the denominator
    the unrounded ones): what the dot-product kernel computes before its output rounding."""
    block_size, group = pool.shape[3], query.shape[1] // pool.shape[2]
    outs = []
    for b, n in enumerate(lens.tolist()):
        pages = tables[b, : -(-n // block_size)]
        k = pool[pages, 0].float().transpose(0, 1).flatten(1, 2)[:, :n]  # [kv_heads, n, d]
        v = pool[pages, 1].float().transpose(0, 1).flatten(1, 2)[:, :n]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        logits = torch.einsum("hd,hnd->hn", query[b].float(), k) * scale
        p = torch.exp(logits - logits.amax(-1, keepdim=True))
        rounded = p.to(torch.bfloat16).float()
        outs.append(torch.einsum("hn,hnd->hd", rounded, v) / p.sum(-1, keepdim=True))
    return torch.stack(outs)


@pytest.mark.parametrize("group", [3, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_logits_exact_and_values_on_rounded_probabilities(group, head_dim):
    lens = [1, 17, 300, 1029]  # one slot, odd counts (a zero partner row), several tiles
    pool, tables, lens_t, _ = make_paged(lens, 2, 16, head_dim, torch.bfloat16, seed=3)
    query = torch.randn(len(lens), 2 * group, head_dim).to(torch.bfloat16)
    scale = head_dim**-0.5
    ref_out, ref_lse, _ = reference_decode(query, pool, tables, lens_t, scale)
    out, lse, _ = ops.paged_decode_attention(query, pool, tables, lens_t, scale, isa="avx512_bf16")
    vec_out, vec_lse, _ = ops.paged_decode_attention(
        query, pool, tables, lens_t, scale, isa="avx512"
    )
    # Exact products: the log-sum-exp is as close to fp32's as the vector kernel's.
    assert (lse - ref_lse).abs().max() <= (vec_lse - ref_lse).abs().max() + 2e-6
    # Against its own rounding of the probabilities, only the bf16 output rounding is left:
    # about the vector kernel's error against the fp32 reference.
    rounded = _rounded_probability_reference(query, pool, tables, lens_t, scale)
    err = (out.float() - rounded).abs()
    vec_err = (vec_out.float() - ref_out).abs()
    assert err.mean() <= 1.25 * vec_err.mean()
    assert err.max() <= 1.5 * vec_err.max() + 1e-4


def test_one_slot_returns_its_value_row_exactly():
    # One held slot: its probability is 1.0, exact in bf16, so the output is the value row.
    pool, tables, lens, _ = make_paged([1, 1], 3, 16, 64, torch.bfloat16, seed=5)
    query = torch.randn(2, 9, 64).to(torch.bfloat16)
    out, lse, _ = ops.paged_decode_attention(query, pool, tables, lens, 0.125, isa="avx512_bf16")
    for b in range(2):
        values = pool[tables[b, 0], 1, :, 0]  # [kv_heads, head_dim]
        torch.testing.assert_close(out[b], values.repeat_interleave(3, dim=0), atol=0, rtol=0)


def test_fp32_query_over_bf16_pages_takes_the_pytorch_route():
    # The pool's dtype decides the query's for bf16 pools: a mismatched fp32 query takes the
    # PyTorch route (ops.supports says no), never a silently rounded kernel call.
    pool, tables, lens, _ = make_paged([40], 1, 16, 64, torch.bfloat16)
    assert not ops.supports(torch.randn(1, 3, 64), pool)
