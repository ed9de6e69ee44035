"""The batch-1 decode fast path: native KV write, bf16 GEMV, packed linears at one row, the
fused ops' per-step scope and the recent-query window, each against the plain code path it stands for."""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.torch_ref import write_kv
from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV
from sparsekv.models import prepack
from sparsekv.models.fused import build, ops
from sparsekv.runner.metadata import BlockTableCache, RequestSlice, build_metadata


def _ext():
    ext = build.load_extension()
    if ext is None:
        pytest.skip("fused ops disabled or not built")
    return ext


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_write_kv_native_equals_reference(dtype):
    _ext()
    torch.manual_seed(0)
    pool = (torch.randn(6, 2, 3, 16, 8) * 20).to(dtype)
    expected = pool.clone()
    fused = (torch.randn(5, 9, 8) * 20).to(dtype)  # strided views, as split from a fused QKV
    key, value = fused[:, 2:5], fused[:, 6:9]
    slots = torch.tensor([0, 17, 95, 40, 63])
    write_kv(expected, slots, key, value)
    ops.write_kv_(pool, slots, key, value)
    assert torch.equal(pool, expected)


def test_write_kv_falls_back_for_other_dtypes():
    pool = torch.zeros(2, 2, 1, 4, 8, dtype=torch.bfloat16)
    expected = pool.clone()
    key, value = torch.randn(1, 1, 8), torch.randn(1, 1, 8)  # fp32 into a bf16 pool
    slots = torch.tensor([5])
    write_kv(expected, slots, key, value)
    ops.write_kv_(pool, slots, key, value)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("shape", [(7, 33), (64, 64), (576, 576), (832, 576), (576, 1536)])
def test_gemv_equals_linear(shape):
    ext = _ext()
    if not ext.has_gemv_bf16():
        pytest.skip("no AVX512-BF16")
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.bfloat16)
    x = torch.randn(1, shape[1], dtype=torch.bfloat16)
    assert torch.equal(ext.gemv_bf16(x, weight), torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_rows_equal_linear(bias):
    if not prepack.can_prepack(torch.bfloat16, "cpu", True):
        pytest.skip("no oneDNN packing")
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 832, bias=bias).bfloat16()
    try:
        packed = prepack.PackedLinear(linear)
    except RuntimeError:
        pytest.skip("oneDNN without bf16 packing")
    x = torch.randn(4, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), linear(x))
        assert torch.equal(packed(x[1:2]), linear(x[1:2]))


def test_native_scope_resolves_once_and_restores(monkeypatch):
    ext = _ext()
    with ops.native_scope():
        assert ops._scope_active and ops._scope_ext is ext
        with ops.native_scope():
            pass
        assert ops._scope_active
    assert not ops._scope_active and ops._scope_ext is None
    monkeypatch.setenv("SPARSEKV_DISABLE_FUSED_OPS", "1")
    with ops.native_scope():
        assert ops._native(torch.zeros(1)) is None


def _old_remember(recent, q, window):
    new = q[-window:].transpose(0, 1)
    if recent is not None and new.shape[1] < window:
        new = torch.cat([recent, new], dim=1)[:, -window:]
    return new.contiguous()


@pytest.mark.parametrize("held,new", [(0, 1), (3, 1), (8, 1), (8, 3), (2, 20), (5, 8)])
def test_remember_queries_window(held, new):
    torch.manual_seed(0)
    window = 8
    state = LayerKV(budget=16)
    recent = torch.randn(4, held, 2) if held else None
    state.recent_queries = recent
    q = torch.randn(new, 4, 2)
    state.remember_queries(q, window)
    expected = _old_remember(recent, q, window)
    assert torch.equal(state.recent_queries, expected) and state.recent_queries.is_contiguous()


@pytest.mark.parametrize("held,steps", [(0, 1), (0, 5), (8, 3), (3, 8), (8, 20), (2, 17)])
def test_remember_query_rows_equal_one_shot(held, steps):
    """Decode rows appended one at a time (stacked when read or every ``window`` rows) give
    the window ``remember_queries`` gives, read at any point."""
    torch.manual_seed(1)
    window = 8
    state, expected = LayerKV(budget=16), LayerKV(budget=16)
    recent = torch.randn(4, held, 2) if held else None
    state.recent_queries = expected.recent_queries = recent
    for step in range(steps):
        q = torch.randn(1, 4, 2)
        state.remember_query(q[0], window)
        expected.remember_queries(q, window)
        if step % 3 == 2:  # reads in between
            assert torch.equal(state.recent_queries, expected.recent_queries)
    assert torch.equal(state.recent_queries, expected.recent_queries)
    assert state.recent_queries.is_contiguous() and state.recent_queries.shape[1] <= window
    state.recent_queries = None
    assert state.recent_queries is None


@pytest.mark.parametrize("held,steps", [(0, 1), (0, 5), (8, 3), (3, 8), (8, 20), (2, 17)])
def test_logged_decode_queries_equal_one_shot(held, steps):
    """Whole steps logged on the request (``log_decode_queries``: every layer's rows stacked,
    the request one row of the batch) give every budgeted layer the window
    ``remember_queries`` gives, whichever layer is read (or written) first, at any point;
    layers without a budget keep none; rows remembered one by one before the log keep their
    place."""
    torch.manual_seed(2)
    window, num_layers, batch, row = 8, 3, 4, 2
    budgets = [16, None, 16]
    kv = RequestKV([LayerKV(budget=b) for b in budgets])
    expected = [LayerKV(budget=b) for b in budgets]
    recent = torch.randn(4, held, 2) if held else None
    for layer in (0, 2):
        kv.layers[layer].recent_queries = expected[layer].recent_queries = recent
    first = torch.randn(4, 2)  # remembered one row at a time, before any log entry
    kv.layers[0].remember_query(first, window)
    expected[0].remember_queries(first[None], window)
    for step in range(steps):
        q = torch.randn(num_layers, batch, 4, 2)
        kv.log_decode_queries(q, row, (0, 1, 2), window)
        for layer in (0, 2):
            expected[layer].remember_queries(q[layer, row][None], window)
        if step % 3 == 2:  # reads in between, the last layer first
            assert torch.equal(kv.layers[2].recent_queries, expected[2].recent_queries)
        assert len(kv._query_log) < window  # merged at least every window steps
    for layer in (0, 2):
        assert torch.equal(kv.layers[layer].recent_queries, expected[layer].recent_queries)
        assert kv.layers[layer].recent_queries.shape[1] <= window
    assert kv.layers[1].recent_queries is None
    kv.log_decode_queries(torch.randn(num_layers, batch, 4, 2), row, (0, 1, 2), window)
    kv.layers[0].recent_queries = None  # a write merges the log first, then replaces
    assert kv.layers[0].recent_queries is None and not kv._query_log
    assert kv.layers[2].recent_queries.shape[1] == min(held + steps + 1, window)


def test_decode_path_logs_queries_once_per_step():
    """The decode path logs one stacked tensor per step and request (not one row per layer),
    and the windows read after ``finish`` hold that step's query of each layer."""
    from sparsekv.kv_cache.spec import LayerSpec
    from sparsekv.kv_cache.storage import KVStorage
    from sparsekv.runner.paged_attention import PagedAttention

    num_layers, heads, kv_heads, d, block = 2, 4, 2, 8, 16
    storages = [KVStorage(8, 0, kv_heads, block, d, torch.float32) for _ in range(num_layers)]
    kvs = [RequestKV([LayerKV(budget=32) for _ in range(num_layers)]) for _ in range(2)]
    tables = [[[1], [2]], [[3], [4]]]
    for kv, request_tables in zip(kvs, tables):
        for state, table in zip(kv.layers, request_tables):
            state.block_table, state.num_slots = list(table), 11  # as _decode_slices plans
    slices = _decode_slices(tables, kvs)
    metadata = build_metadata(slices, num_layers, block, torch.device("cpu"))
    ctx = PagedAttention(storages, metadata, [LayerSpec("full")] * num_layers, storages[0].backend)
    torch.manual_seed(3)
    queries = [torch.randn(2, heads, d) for _ in range(num_layers)]
    for layer in range(num_layers):
        k, v = torch.randn(2, kv_heads, d), torch.randn(2, kv_heads, d)
        ctx.attend(layer, queries[layer], k, v, d**-0.5)
    assert all(len(kv._query_log) == 0 for kv in kvs)  # logged at finish, not per layer
    ctx.finish()
    for row, kv in enumerate(kvs):
        assert len(kv._query_log) == 1
        for layer in range(num_layers):
            window = kv.layers[layer].recent_queries
            assert torch.equal(window[:, -1], queries[layer][row])


def _decode_slices(tables_per_request: list[list[list[int]]], kvs: list[RequestKV]):
    slices = []
    for i, (tables, kv) in enumerate(zip(tables_per_request, kvs)):
        steps = [LayerStep(table, 0, 16 * len(table) - 5, 1) for table in tables]
        slices.append(RequestSlice(f"r{i}", i, 1, steps, kv, None, 4))
    return slices


def test_decode_block_tables_cached_only_while_unchanged():
    """The runner's table cache (``BlockTableCache``) gives the tables of the step's lists, also
    after the lists were edited in place or replaced between steps."""
    tables = [[[3, 4, 5], [6, 7]], [[8], [9, 10, 11, 12]]]
    kvs = [RequestKV([LayerKV(), LayerKV()]) for _ in tables]
    cache = BlockTableCache()
    for edit in (None, "append", "swap", "replace"):
        if edit == "append":
            tables[0][1].append(13)
        elif edit == "swap":
            tables[1][1][2] = 42
        elif edit == "replace":
            tables[0][0] = [1, 2]
        meta = build_metadata(_decode_slices(tables, kvs), 2, 16, torch.device("cpu"), cache)
        for layer in range(2):
            got = meta.decode[layer].block_tables
            for i, request_tables in enumerate(tables):
                table = request_tables[layer]
                assert got[i, : len(table)].tolist() == table
                assert not got[i, len(table) :].any()
