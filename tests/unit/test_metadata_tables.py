"""The decode metadata's block tables: ``BlockTableCache`` gives, step after step, exactly the
tables a fresh build converts, whatever happened to the page lists in between."""

from __future__ import annotations

import torch

from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV
from sparsekv.runner.metadata import BlockTableCache, RequestSlice, build_metadata

CPU = torch.device("cpu")


def _slices(tables: list[list[list[int]]], num_new: list[int] | None = None) -> list[RequestSlice]:
    """Decode slices over ``tables[request][layer]``, each layer holding its pages but 5 slots
    (a request with ``num_new[i] > 1`` takes the general path)."""
    slices, start = [], 0
    for i, request_tables in enumerate(tables):
        new = 1 if num_new is None else num_new[i]
        steps = [LayerStep(t, 0, max(0, 16 * len(t) - 5), new) for t in request_tables]
        kv = RequestKV([LayerKV() for _ in request_tables])
        slices.append(RequestSlice(f"r{i}", start, new, steps, kv, None, 4))
        start += new
    return slices


def _assert_same(got, expected) -> None:
    def ids(layers):
        return [[s.request_id for s in layer] for layer in layers]

    assert ids(got.general) == ids(expected.general)
    for a, b in zip(got.decode, expected.decode):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert [s.request_id for s in a.slices] == [s.request_id for s in b.slices]
        for name in ("rows", "slot_mapping", "block_tables", "seq_lens", "first_slots"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape and torch.equal(x, y), name
        assert a.all_rows == b.all_rows


def test_cached_tables_equal_fresh_ones_across_edits():
    """Appends, in-place edits, trims, replaced lists, a wider or narrower longest table and a
    changed batch all give the fresh build's tensors."""
    tables = [[[3, 4, 5], [6, 7]], [[8], [9, 10, 11, 12]], [[20, 21], [22]]]
    cache = BlockTableCache()
    edits = [
        lambda: None,
        lambda: tables[0][1].append(13),
        lambda: tables[1][1].__setitem__(2, 42),
        lambda: tables[0].__setitem__(0, [1, 2]),
        lambda: tables[1][1].extend([50, 51, 52]),  # wider
        lambda: tables[1][1].__delitem__(slice(2, None)),  # narrower
        lambda: tables.pop(1),  # a request leaves
        lambda: tables.append([[60], [61, 62]]),  # another joins
        lambda: None,
    ]
    for edit in edits:
        edit()
        got = build_metadata(_slices(tables), 2, 16, CPU, cache)
        _assert_same(got, build_metadata(_slices(tables), 2, 16, CPU))
        for layer in range(2):
            block_tables = got.decode[layer].block_tables
            for i, request_tables in enumerate(tables):
                table = request_tables[layer]
                assert block_tables[i, : len(table)].tolist() == table
                assert not block_tables[i, len(table) :].any()


def test_cached_tables_with_a_general_path_request():
    """A prefill chunk beside decodes, then a decode-only step, with one cache."""
    tables = [[[3, 4, 5], [6, 7]], [[8], [9, 10]], [[20, 21], [22]]]
    cache = BlockTableCache()
    for num_new in ([1, 7, 1], [1, 1, 1], [3, 1, 1], [1, 1, 1]):
        got = build_metadata(_slices(tables, num_new), 2, 16, CPU, cache)
        _assert_same(got, build_metadata(_slices(tables, num_new), 2, 16, CPU))
        tables[0][0].append(len(tables[0][0]) + 30)


def test_cached_counts_follow_the_held_slots():
    """Unchanged tables, other held and first slots: the reused tensors show the new counts."""
    tables = [[[3, 4, 5], [6, 7]], [[8, 9], [10, 11, 12]]]
    cache = BlockTableCache()
    for held, first in ((20, 0), (21, 0), (33, 16), (40, 16)):
        slices = _slices(tables)
        for s in slices:
            s.layers = [LayerStep(step.block_table, first, held - first, 1) for step in s.layers]
        got = build_metadata(slices, 2, 16, CPU, cache)
        _assert_same(got, build_metadata(slices, 2, 16, CPU))
        assert got.decode[0].seq_lens.tolist() == [held + 1, held + 1]


def test_device_mirror_copies_only_changed_rows_into_persistent_tensors():
    """With a host mirror (the accelerator route, exercised on CPU) the tensors stay at their
    addresses while the widest table fits their power-of-two width, only rows whose list
    changed are copied, and the values are the fresh build's (zero padded to the width)."""
    tables = [[[3, 4, 5], [6, 7]], [[8], [9, 10]], [[20, 21], [22]]]
    cache = BlockTableCache(CPU, mirror=True)
    steps = [
        (lambda: None, 6),  # first build: every row
        (lambda: None, 0),
        (lambda: tables[0][1].append(13), 1),
        (lambda: (tables[1][0].append(30), tables[2][0].append(31)), 2),
        (lambda: tables[1][1].__setitem__(0, 42), 1),
        (lambda: tables[2][1].extend(range(50, 58)), 6),  # past 8 pages: wider, all rows
        (lambda: tables[0][0].append(60), 1),
    ]
    pointers = []
    for edit, rows in steps:
        edit()
        before = cache.rows_copied
        got = build_metadata(_slices(tables), 2, 16, CPU, cache)
        assert cache.rows_copied - before == rows
        fresh = build_metadata(_slices(tables), 2, 16, CPU)
        for a, b in zip(got.decode, fresh.decode):
            width = b.block_tables.shape[1]
            assert a.block_tables.shape[1] in (8, 16)
            assert torch.equal(a.block_tables[:, :width], b.block_tables)
            assert not a.block_tables[:, width:].any()
            for name in ("slot_mapping", "seq_lens", "first_slots"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
        pointers.append(got.decode[0].block_tables.data_ptr())
    assert len(set(pointers[:5])) == 1 and pointers[5] == pointers[6] != pointers[0]
