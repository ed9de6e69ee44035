"""Swapping a request's pages out to host memory and back restores them bit for bit, through
``kv_cache.swap_copies`` (pinned side-stream copies on CUDA, plain copies on CPU)."""

from __future__ import annotations

import pytest
import torch

from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.kv_cache.swap_copies import to_device, to_host


def test_to_host_and_back_is_exact_and_detached():
    source = torch.randn(3, 2, 4)
    (host,) = to_host([source.index_select(0, torch.tensor([2, 0]))])
    source.zero_()  # the copy does not alias the pool
    (back,) = to_device((host,), torch.device("cpu"))
    assert torch.equal(back, host) and host.abs().sum() > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_out_and_in_restores_the_pages(kv_cache_dtype):
    torch.manual_seed(0)
    kv = KVCacheManager(
        [LayerSpec("full")] * 2, 12, 4, 2, 8, torch.float32, kv_cache_dtype=kv_cache_dtype
    )
    kv.register("a", [None, None], None)
    state = kv.get("a")
    for layer in state.layers:
        layer.block_table = kv.pool.allocate(3)
    for storage in kv.storages:
        for tensor in storage.tensors:
            tensor.copy_((torch.randn(tensor.shape) * 50).to(tensor.dtype))
    before = [kv.storage(i).read_pages(layer.block_table) for i, layer in enumerate(state.layers)]
    kv.swap_out("a")
    assert kv.pool.num_free_pages == 12 and state.layers[0].block_table == []
    blocker = kv.pool.allocate(2)  # the request comes back to other pages
    kv.swap_in("a")
    assert not set(blocker) & {p for layer in state.layers for p in layer.block_table}
    for i, layer in enumerate(state.layers):
        after = kv.storage(i).read_pages(layer.block_table)
        assert all(torch.equal(a, b) for a, b in zip(after, before[i]))
