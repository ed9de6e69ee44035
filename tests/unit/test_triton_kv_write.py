"""Triton page writes against the PyTorch references, bit for bit (interpreted on CPU
tensors; on a GPU with ``SPARSEKV_TEST_DEVICE=cuda``): KV write by slot mapping (negative
slots skipped), kept-slot write of a prefill compaction, slot moves in place and into fresh
pages, int8 codes and their scales written like any page.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.kv_cache import quant
from tests import triton_kernels
from tests.triton_kernels import DEVICE, DTYPES, triton_mode  # noqa: F401

kernels = triton_kernels.load()
KV_HEADS, BLOCK, HEAD_DIM = 3, 16, 24


def random_pool(num_pages, dtype, seed=0, head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, 2, KV_HEADS, BLOCK, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_by_slot_and_skips_negative_slots(dtype):
    pool = random_pool(10, dtype)
    slots = torch.tensor([5, 17, -1, 100, 33])
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen)  # fp32: converted on write
    value = torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen)
    expected = pool.clone()
    real = slots >= 0
    torch_ref.write_kv(expected, slots[real], key[real], value[real])
    written = pool.to(DEVICE)
    kernels.kv_write.write_kv(written, slots.to(DEVICE), key.to(DEVICE), value.to(DEVICE))
    assert torch.equal(written.cpu(), expected)


def test_write_kv_writes_int8_codes_and_their_scales():
    """Quantized pages go through the same kernel: codes as a pool, scales as a pool of
    ``head_dim`` 1 (a strided view), as ``ScaledStorage`` writes them."""
    codes = torch.zeros(4, 2, KV_HEADS, BLOCK, HEAD_DIM, dtype=torch.int8)
    scales = torch.zeros(4, 2, KV_HEADS, BLOCK)
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(2, 3, KV_HEADS, HEAD_DIM, generator=gen)
    (key_codes, key_scales), (value_codes, value_scales) = map(quant.quantize_int8, (key, value))
    slots = torch.tensor([3, 40, 63])
    expected_codes, expected_scales = codes.clone(), scales.clone()
    torch_ref.write_kv(expected_codes, slots, key_codes, value_codes)
    torch_ref.write_kv(
        expected_scales[..., None], slots, key_scales[..., None], value_scales[..., None]
    )
    codes, scales, slots = codes.to(DEVICE), scales.to(DEVICE), slots.to(DEVICE)
    kernels.kv_write.write_kv(codes, slots, key_codes.to(DEVICE), value_codes.to(DEVICE))
    kernels.kv_write.write_kv(
        scales[..., None],
        slots,
        key_scales[..., None].to(DEVICE),
        value_scales[..., None].to(DEVICE),
    )
    assert torch.equal(codes.cpu(), expected_codes) and torch.equal(scales.cpu(), expected_scales)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kept_slots_equals_write_leading_of_the_gathered_rows(dtype):
    gen = torch.Generator().manual_seed(3)
    pool = random_pool(10, dtype, seed=4)
    key = torch.randn(KV_HEADS, 50, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(KV_HEADS, 50, HEAD_DIM, generator=gen).to(dtype)
    kept = torch.stack([torch.randperm(50, generator=gen)[:37] for _ in range(KV_HEADS)])
    table = torch.tensor([4, 8, 2])
    expected = pool.clone()
    heads = torch.arange(KV_HEADS)[:, None]
    torch_ref.write_leading_slots(expected, table.tolist(), key[heads, kept], value[heads, kept])
    written = pool.to(DEVICE)
    kernels.kv_write.write_kept_slots(
        written, table.to(DEVICE), key.to(DEVICE), value.to(DEVICE), kept.to(DEVICE)
    )
    assert torch.equal(written.cpu(), expected)


@pytest.mark.parametrize("in_place", [True, False])
def test_move_slots_in_place_and_to_fresh_pages(in_place):
    gen = torch.Generator().manual_seed(5)
    pool = random_pool(40, torch.float32, seed=6, head_dim=64)
    source = torch.tensor([[7, 3, 30, 12, 5], [8, 9, 1, 2, 20]])
    kept = torch.stack(
        [torch.randperm(70, generator=gen)[:37].sort().values for _ in range(2 * KV_HEADS)]
    ).view(2, KV_HEADS, 37)
    kept[0, 0] = torch.arange(37)  # nothing moves: every slot is its own source
    target = source[:, :3] if in_place else torch.tensor([[33, 34, 35], [36, 37, 38]])
    moved = pool.clone().to(DEVICE)  # a copy on the CPU too
    kernels.kv_write.move_slots(moved, source.to(DEVICE), target.to(DEVICE), kept.to(DEVICE))
    moved = moved.cpu()
    heads = torch.arange(KV_HEADS)[:, None]
    for layer in range(2):
        key, value = torch_ref.gather_kv(pool, source[layer], 70)
        moved_key, moved_value = torch_ref.gather_kv(moved, target[layer], 37)
        assert torch.equal(moved_key, key[heads, kept[layer]])
        assert torch.equal(moved_value, value[heads, kept[layer]])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[target.flatten()] = False
    assert torch.equal(moved[untouched], pool[untouched])
