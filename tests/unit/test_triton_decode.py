"""Triton paged decode attention against ``torch_ref`` (interpreted on CPU tensors; on a GPU
with ``SPARSEKV_TEST_DEVICE=cuda``): GQA groups 1/2/3/4/7/8 and head_dim 64/96/128/256 (a
sampled subset of the product), pages of 16 and 32 slots, ragged and page-unaligned lengths
(1 included), ``first_slot > 0``, padding rows, sliding window, soft-cap, split-KV, attention
mass, and int8 / fp8 pages (against the reference over the dequantized pool). fp32 within
1e-5; fp16 (and bf16 on a GPU) against the fp32 reference of the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.kv_cache import quant
from tests import triton_kernels
from tests.triton_kernels import DEVICE, DTYPES, tolerance, triton_mode  # noqa: F401

kernels = triton_kernels.load()

# (group, head_dim, block_size, lens, first_slots, options); lens == first marks a padding row.
CASES = [
    (1, 64, 16, [1, 17, 40], [0, 0, 0], {}),
    (2, 96, 32, [33, 5, 0], [0, 0, 0], {"num_splits": 3}),
    (3, 128, 16, [50, 16], [16, 0], {"sliding_window": 20}),
    (4, 256, 32, [70], [32], {"logit_softcap": 5.0}),
    (7, 64, 16, [1, 23, 48], [0, 0, 48], {"return_attn_mass": True}),
    (8, 128, 32, [45, 64], [32, 0], {"return_attn_mass": True, "num_splits": 2}),
    (2, 64, 16, [37, 9], [16, 0], {"sliding_window": 12, "logit_softcap": 2.0}),
]
# Every case in fp32; 16-bit dtypes on the cases without 3 or 8 query heads per KV head
# (interpreter time).
PARAMS = [
    pytest.param(*case, dtype, id=f"g{case[0]}-d{case[1]}-bs{case[2]}-{'-'.join(case[5])}-{dtype}")
    for dtype in DTYPES
    for case in CASES
    if dtype == torch.float32 or case[0] not in (3, 8)
]
NUM_KV_HEADS = 2


def make_paged(lens, first, block_size, head_dim, seed=0):
    """A random pool with each request's held pages at shuffled page ids; padding table
    entries point at a valid page (they are masked)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-(n - f) // block_size) for n, f in zip(lens, first)]
    max_blocks = max(blocks) + 1
    num_pages = sum(blocks) + 3
    pool = torch.randn(num_pages, 2, NUM_KV_HEADS, block_size, head_dim, generator=gen)
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.full((len(lens), max_blocks), int(perm[-1]), dtype=torch.long)
    used = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = perm[used : used + count]
        used += count
    return pool, tables, torch.tensor(lens), torch.tensor(first)


def reference(query, pool, tables, lens, first, options):
    """torch_ref in fp32 over the rows that see a slot (it has no answer for padding rows)."""
    options = {k: v for k, v in options.items() if k != "num_splits"}
    real = lens > first
    out, lse, mass = torch_ref.paged_decode_attention(
        query[real].float(), pool.float(), tables[real], lens[real], 0.1, first[real], **options
    )
    return real, out, lse, mass


def check(result, expected, dtype):
    real, out, lse, mass = expected
    got_out, got_lse, got_mass = (t.cpu() if t is not None else None for t in result)
    tol = tolerance(dtype)
    torch.testing.assert_close(got_out[real].float(), out, **tol)
    torch.testing.assert_close(got_lse[real], lse, **tol)
    if mass is not None:
        torch.testing.assert_close(got_mass[real], mass, **tol)
    else:
        assert got_mass is None
    # Padding rows: zero output, lse -inf, no mass.
    assert torch.equal(got_out[~real].float(), torch.zeros_like(got_out[~real].float()))
    assert torch.isneginf(got_lse[~real]).all()
    if got_mass is not None:
        assert not got_mass[~real].any()


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "lens", "first", "options", "dtype"), PARAMS
)
def test_decode_matches_reference(group, head_dim, block_size, lens, first, options, dtype):
    pool, tables, seq_lens, first_slots = make_paged(lens, first, block_size, head_dim)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(len(lens), group * NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    pool = pool.to(dtype)
    expected = reference(query, pool, tables, seq_lens, first_slots, options)
    result = kernels.decode.paged_decode_attention(
        query.to(DEVICE), pool.to(DEVICE), tables.to(DEVICE), seq_lens.to(DEVICE), 0.1,
        first_slots.to(DEVICE), **options,
    )  # fmt: skip
    assert result[0].dtype == dtype and result[1].dtype == torch.float32
    check(result, expected, dtype)


def test_split_kv_equals_one_split():
    """Partials merged by their LSE give what one walk over the table gives."""
    pool, tables, seq_lens, first = make_paged([61, 3], [0, 0], 16, 64, seed=4)
    query = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(5))
    args = [t.to(DEVICE) for t in (query, pool, tables, seq_lens)]
    one = kernels.decode.paged_decode_attention(*args, 0.1, num_splits=1)
    four = kernels.decode.paged_decode_attention(*args, 0.1, num_splits=4)
    torch.testing.assert_close(four[0], one[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(four[1], one[1], atol=1e-6, rtol=0)


QUANT_CASES = [
    ("int8", torch.float32, {}),
    ("fp8", torch.float32, {"sliding_window": 10, "return_attn_mass": True}),
    ("int8", torch.float16, {"logit_softcap": 3.0, "num_splits": 2}),
    ("fp8", torch.float16, {}),
]


@pytest.mark.parametrize(("fmt", "dtype", "options"), QUANT_CASES)
def test_quantized_decode_matches_dequantized_reference(fmt, dtype, options):
    pool, tables, seq_lens, first = make_paged([1, 30, 47], [0, 16, 0], 16, 64, seed=2)
    if fmt == "int8":
        codes, scales = quant.quantize_int8(pool)
        dequantized = quant.dequantize_int8(codes, scales, torch.float32)
    else:
        codes, scales = quant.quantize_fp8(pool)
        dequantized = quant.dequantize_fp8(codes, scales, torch.float32)
    query = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    expected = reference(query, dequantized, tables, seq_lens, first, options)
    result = kernels.decode.paged_decode_attention_quantized(
        query.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), tables.to(DEVICE),
        seq_lens.to(DEVICE), 0.1, first.to(DEVICE), **options,
    )  # fmt: skip
    check(result, expected, dtype)


def test_quantized_decode_rejects_bad_codes_and_scales():
    codes = torch.zeros(2, 2, 1, 16, 64, dtype=torch.int8)
    scales = torch.ones(2, 2, 1, 16)
    query = torch.zeros(1, 2, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    with pytest.raises(ValueError, match="kv_data"):
        kernels.decode.paged_decode_attention_quantized(
            query, codes.view(torch.uint8), scales, tables, lens, 0.1
        )
    with pytest.raises(ValueError, match="kv_scales"):
        kernels.decode.paged_decode_attention_quantized(query, codes, scales[:1], tables, lens, 0.1)


def test_decode_rejects_head_mismatch_and_handles_empty_batch():
    pool = torch.zeros(2, 2, 3, 16, 64, device=DEVICE)
    tables = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
    lens = torch.tensor([3], device=DEVICE)
    with pytest.raises(ValueError, match="query"):
        kernels.decode.paged_decode_attention(
            torch.zeros(1, 4, 64, device=DEVICE), pool, tables, lens, 0.1
        )
    out, lse, mass = kernels.decode.paged_decode_attention(
        torch.zeros(0, 6, 64, device=DEVICE), pool, tables[:0], lens[:0], 0.1, return_attn_mass=True
    )
    assert out.shape == (0, 6, 64) and lse.shape == (0, 6) and mass.shape == (0, 3, 0)
