"""Decode-time compaction read from the pages (``runner.compaction``) equals the general
route that gathers the layers (``step_compression.compact_decode_stacked``)."""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.torch_ref import gather_kv, write_leading_slots
from sparsekv.compression.h2o import H2OCompressor
from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV
from sparsekv.kv_cache.storage import KVStorage
from sparsekv.runner import compaction, step_compression
from sparsekv.runner.metadata import RequestSlice
from sparsekv.runner.paged_attention import PagedAttention

BLOCK = 16
KV_HEADS, HEADS, HEAD_DIM = 3, 9, 64
SCALE = HEAD_DIM**-0.5
NATIVE = CpuNativeBackend()


def _setup(
    num_layers: int, num_slots: int, budget: int, window: int, copy_on_write: bool, seed: int
):
    """A storage with ``num_layers`` layers of one request holding ``num_slots`` slots on
    shuffled pages, and the request's decode-compaction slice."""
    g = torch.Generator().manual_seed(seed)
    storage = KVStorage(400, 0, KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16)
    storage.tensors[0].copy_(torch.randn(storage.tensors[0].shape, generator=g))
    order = torch.randperm(400, generator=g).tolist()
    num_blocks = -(-num_slots // BLOCK)
    layers, steps = [], []
    for _ in range(num_layers):
        table = [order.pop() for _ in range(num_blocks)]
        queries = torch.randn(HEADS, window, HEAD_DIM, generator=g)
        state = LayerKV(table, num_slots - 1, 0, budget=budget)
        state.recent_queries = queries.to(torch.bfloat16)
        layers.append(state)
        compact = [order.pop() for _ in range(-(-budget // BLOCK))] if copy_on_write else None
        steps.append(
            LayerStep(table, 0, num_slots - 1, 1, compress_to=budget, compact_table=compact,
                      decode_compaction=True)
        )  # fmt: skip
    compressor = SnapKVCompressor(window=window, pooling="max", kernel_size=7)
    request = RequestSlice("r", 0, 1, steps, RequestKV(layers), compressor, window)
    return storage, request


def _kept_kv(storage, request, budget):
    out = []
    for step in request.layers:
        table = step.compact_table if step.compact_table is not None else step.block_table
        out.append(gather_kv(storage.tensors[0], storage.local(table), budget))
    return out


@pytest.mark.parametrize(
    ("num_layers", "num_slots", "budget", "window", "copy_on_write"),
    [
        (4, 1040, 1024, 32, False),
        (2, 56, 40, 8, False),
        (3, 300, 257, 32, True),
        (1, 48, 32, 32, False),
    ],
)
@pytest.mark.kernel_variant("window_fused")  # every fused window kernel variant this CPU runs
def test_compaction_from_pages_equals_gathered_route(
    num_layers, num_slots, budget, window, copy_on_write
):
    layers = list(range(num_layers))
    storage, request = _setup(num_layers, num_slots, budget, window, copy_on_write, seed=budget)
    reference, ref_request = _setup(
        num_layers, num_slots, budget, window, copy_on_write, seed=budget
    )
    assert compaction.applies(request, layers, [storage] * num_layers, NATIVE)

    compaction.compact_from_pages(request, layers, [storage] * num_layers, SCALE, NATIVE)
    attention = PagedAttention([reference] * num_layers, None, [None] * num_layers, NATIVE)
    step_compression.compact_decode_stacked(attention, ref_request, layers, SCALE)

    for (k, v), (ref_k, ref_v) in zip(
        _kept_kv(storage, request, budget), _kept_kv(reference, ref_request, budget)
    ):
        torch.testing.assert_close(k, ref_k, rtol=0, atol=0)
        torch.testing.assert_close(v, ref_v, rtol=0, atol=0)


@pytest.mark.kernel_variant("decode")  # the extension, any variant
@pytest.mark.parametrize("backend", [NATIVE, TorchBackend()], ids=["cpu", "torch"])
def test_move_slots_in_place_and_to_fresh_pages(backend):
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(40, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(torch.bfloat16)
    source = torch.tensor([[7, 3, 30, 12, 5], [8, 9, 1, 2, 20]])
    kept = torch.stack([torch.randperm(70, generator=g)[:37].sort().values for _ in range(6)])
    kept = kept.view(2, KV_HEADS, 37)
    expected = []
    for layer in range(2):
        k, v = gather_kv(pool, source[layer], 70)
        heads = torch.arange(KV_HEADS)[:, None]
        expected.append((k[heads, kept[layer]].clone(), v[heads, kept[layer]].clone()))
    for target in (source[:, :3], torch.tensor([[33, 34, 35], [36, 37, 38]])):
        moved = pool.clone()
        backend.move_slots(moved, source, target, kept)
        for layer in range(2):
            k, v = gather_kv(moved, target[layer], 37)
            assert torch.equal(k, expected[layer][0]) and torch.equal(v, expected[layer][1])
        # Pages outside the targets are untouched.
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[target.flatten()] = False
        assert torch.equal(moved[untouched], pool[untouched])
    # Matches the page writer used by the general route.
    written = pool.clone()
    write_leading_slots(written, [33, 34, 35], *expected[0])
    assert torch.equal(gather_kv(written, torch.tensor([33, 34, 35]), 37)[0], expected[0][0])


@pytest.mark.kernel_variant("window_fused")  # every fused window kernel variant this CPU runs
def test_applies_only_to_window_scored_plain_bf16_pages():
    storage, request = _setup(2, 56, 40, 8, False, seed=1)
    assert compaction.applies(request, [0, 1], [storage, storage], NATIVE)
    assert not compaction.applies(request, [0, 1], [storage, storage], TorchBackend())
    other = KVStorage(200, 0, KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16)
    assert not compaction.applies(request, [0, 1], [storage, other], NATIVE)  # two storages
    fp32 = KVStorage(200, 0, KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    assert not compaction.applies(request, [0, 1], [fp32, fp32], NATIVE)
    request.compressor = H2OCompressor(window=8)
    assert not compaction.applies(request, [0, 1], [storage, storage], NATIVE)


@pytest.mark.kernel_variant("decode")  # the extension, any variant
def test_move_slots_rejects_out_of_range_slots_and_pages():
    pool = torch.zeros(4, 2, KV_HEADS, BLOCK, HEAD_DIM, dtype=torch.bfloat16)
    kept = torch.arange(3).expand(1, KV_HEADS, 3).contiguous()
    with pytest.raises(RuntimeError, match="outside the source table"):
        NATIVE.move_slots(pool, torch.tensor([[0]]), torch.tensor([[1]]), kept + BLOCK)
    with pytest.raises(RuntimeError, match="out of range"):
        NATIVE.move_slots(pool, torch.tensor([[9]]), torch.tensor([[1]]), kept)
