"""The native prefill compaction write (``cpu.kept_slots``) leaves the pages bit-identical to
gathering the kept rows and writing them with ``torch_ref.write_leading_slots``."""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.cpu import build
from sparsekv.attention.cpu.kept_slots import supports_kept_slots, write_kept_slots
from sparsekv.attention.torch_ref import write_leading_slots
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.storage import make_storage

KV_HEADS, HEAD_DIM, NUM_PAGES = 3, 64, 48

# Skipped only where the native kernels are off on purpose: a failed build fails these tests.
needs_extension = pytest.mark.skipif(
    build.native_disabled(), reason="SPARSEKV_DISABLE_NATIVE is set"
)


def _kept(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    """``[KV_HEADS, k]`` ascending rows of ``n``, different per head, with the last rows kept
    (a window) and a run of consecutive rows, as compressors select."""
    rows = []
    for _ in range(KV_HEADS):
        recent = min(k, 5)
        older = torch.randperm(n - recent, generator=g)[: k - recent].sort().values
        rows.append(torch.cat([older, torch.arange(n - recent, n)]))
    return torch.stack(rows).view(KV_HEADS, k)


def _expected(pool, table, key, value, kept) -> torch.Tensor:
    expected = pool.clone()
    heads = torch.arange(KV_HEADS)[:, None]
    write_leading_slots(expected, table, key[heads, kept], value[heads, kept])
    return expected


@needs_extension
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("k", [0, 1, 15, 16, 33, 64, 100])
def test_native_write_equals_gather_then_write_leading(dtype, block_size, k):
    g = torch.Generator().manual_seed(block_size * 1000 + k)
    n = 130
    pool = torch.randn(NUM_PAGES, 2, KV_HEADS, block_size, HEAD_DIM, generator=g).to(dtype)
    key = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g).to(dtype)
    value = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g).to(dtype)
    kept = _kept(g, n, k)
    table = torch.randperm(NUM_PAGES, generator=g)[: -(-k // block_size) + 1]
    expected = _expected(pool, table.tolist(), key, value, kept)
    assert supports_kept_slots(pool, key, value)
    write_kept_slots(pool, table, key, value, kept)
    assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))


@needs_extension
def test_native_write_reads_strided_rows():
    """Keys with a row stride other than ``head_dim`` (a ``[n, heads, d]`` tensor transposed)
    and values with a head stride past ``n`` rows (a slice of a longer tensor)."""
    g = torch.Generator().manual_seed(7)
    n, k, block_size = 90, 41, 16
    pool = torch.randn(NUM_PAGES, 2, KV_HEADS, block_size, HEAD_DIM, generator=g)
    pool = pool.to(torch.bfloat16)
    key = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16).transpose(0, 1)
    value = torch.randn(KV_HEADS, n + 20, HEAD_DIM, generator=g).to(torch.bfloat16)[:, :n]
    kept = _kept(g, n, k)
    table = torch.tensor([40, 2, 17])
    expected = _expected(pool, table.tolist(), key, value, kept)
    write_kept_slots(pool, table, key, value, kept)
    assert torch.equal(pool, expected)


@needs_extension
def test_native_write_rejects_out_of_range_rows_and_pages():
    pool = torch.zeros(4, 2, KV_HEADS, 16, HEAD_DIM, dtype=torch.bfloat16)
    key = torch.zeros(KV_HEADS, 20, HEAD_DIM, dtype=torch.bfloat16)
    kept = torch.arange(3).expand(KV_HEADS, 3).contiguous()
    with pytest.raises(RuntimeError, match="outside the 20 rows"):
        write_kept_slots(pool, torch.tensor([1]), key, key, kept + 20)
    with pytest.raises(RuntimeError, match="out of range"):
        write_kept_slots(pool, torch.tensor([9]), key, key, kept)
    with pytest.raises(RuntimeError, match="pool's dtype"):
        write_kept_slots(pool, torch.tensor([1]), key.float(), key.float(), kept)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "int4"])
@pytest.mark.parametrize("native", [True, False])
def test_storage_write_kept_equals_write_leading_of_the_gathered_rows(
    kv_cache_dtype, native, monkeypatch
):
    """Every format (quantized ones encode through their ``write_leading``), with and without
    the native kernels, and a storage whose page ids start past 0."""
    if not native:
        monkeypatch.setenv("SPARSEKV_DISABLE_NATIVE", "1")
    elif build.native_disabled():
        pytest.skip("SPARSEKV_DISABLE_NATIVE is set")
    else:
        assert build.load_extension() is not None, "the native extension failed to build"
    g = torch.Generator().manual_seed(11)
    n, k, block_size, offset = 70, 37, 16, 100
    key = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g).to(torch.bfloat16)
    value = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g).to(torch.bfloat16)
    kept = _kept(g, n, k)
    table = [offset + 9, offset + 1, offset + 30]
    stores, states = [], []
    for _ in range(2):  # the same pages, written each way
        store = make_storage(
            kv_cache_dtype, 40, offset, KV_HEADS, block_size, HEAD_DIM, torch.bfloat16
        )
        fill = torch.Generator().manual_seed(5)
        for tensor in store.tensors:
            tensor.copy_(torch.randint(0, 50, tensor.shape, generator=fill))
        stores.append(store)
        states.append(LayerKV(budget=k))
    stores[0].write_kept(states[0], table, key, value, kept)
    heads = torch.arange(KV_HEADS)[:, None]
    stores[1].write_leading(states[1], table, key[heads, kept], value[heads, kept])
    for written, expected in zip(stores[0].tensors, stores[1].tensors):
        assert torch.equal(written, expected)
    if kv_cache_dtype == "int4":  # the partial last page's slots stay at full precision
        assert all(torch.equal(a, b) for a, b in zip(states[0].residual, states[1].residual))
