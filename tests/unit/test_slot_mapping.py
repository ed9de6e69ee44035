"""Physical slots of a chunk's writes (``KVStorage._slot_mapping`` / ``write_slots``)."""

from __future__ import annotations

import random

import torch

from sparsekv.kv_cache.storage.base import SMALL_SLOT_MAPPING, KVStorage


def test_slot_mapping_matches_the_whole_table_formula():
    """Only the pages the slots fall in are converted; the slots equal those computed from the
    whole table, for starts and counts across page boundaries and a non-zero page offset, on
    both paths (Python ints up to SMALL_SLOT_MAPPING slots, tensors above)."""
    block_size, page_offset = 4, 3
    store = KVStorage(12, page_offset, 1, block_size, 8, torch.float32)
    rng = random.Random(0)
    paths = set()
    for _ in range(200):
        table = rng.sample(range(page_offset, page_offset + 12), 12)
        start = rng.randrange(0, 40)
        count = rng.randrange(1, 48 - start + 1)
        held = torch.arange(start, start + count)
        local = torch.tensor(table) - page_offset
        want = local[held // block_size] * block_size + held % block_size
        assert torch.equal(store._slot_mapping(table, start, count), want)
        paths.add(count <= SMALL_SLOT_MAPPING)
    assert paths == {True, False}


def test_write_slots_lands_where_gather_reads():
    """Rows written after ``start`` held slots read back at those positions, the slots before
    untouched."""
    store = KVStorage(6, 0, 2, 4, 8, torch.float32)
    table = [4, 1, 5, 0]
    key = torch.randn(2, 7, 8)
    value = torch.randn(2, 7, 8)
    store.write_slots(None, table, 5, key, value)
    keys, values = store.gather(None, table, 12)
    assert torch.equal(keys[:, 5:12], key) and torch.equal(values[:, 5:12], value)
    assert torch.count_nonzero(keys[:, :5]) == 0
