"""``runner.chunk_batch.chunk_plan``: the batched chunk call's rows, block tables, slot counts
and write slots, against values worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsekv.runner.chunk_batch import chunk_plan


def _request(start: int, num_rows: int, held: int, table: list[int]) -> SimpleNamespace:
    step = SimpleNamespace(num_held=held, block_table=table)
    return SimpleNamespace(start=start, num_rows=num_rows, layers=[None, step])


def test_plan_of_three_ragged_chunks():
    # block size 4; request 0: 5 held slots (pages 10, 11), 3 new rows -> held slots 5, 6, 7
    # on page 11; request 1: 4 held (page 20), 2 new -> slots 4, 5 on page 21 (a third page in
    # the table is not needed); request 2: 0 held, 1 new on page 30.
    chosen = [
        _request(start=2, num_rows=3, held=5, table=[10, 11]),
        _request(start=7, num_rows=2, held=4, table=[20, 21, 22]),
        _request(start=0, num_rows=1, held=0, table=[30]),
    ]
    plan = chunk_plan(chosen, layer=1, block_size=4, page_offset=8)
    assert plan.rows.tolist() == [2, 3, 4, 7, 8, 0]
    assert plan.row_starts.tolist() == [0, 3, 5, 6]
    assert plan.held.tolist() == [5, 4, 0]
    # local ids (minus 8); padding 0 - 8 clamps to 0
    assert plan.tables.tolist() == [[2, 3], [12, 13], [22, 0]]
    assert plan.slots.tolist() == [11 * 4 + 1, 11 * 4 + 2, 11 * 4 + 3, 21 * 4, 21 * 4 + 1, 120]
    for tensor in (plan.rows, plan.tables, plan.row_starts, plan.held, plan.slots):
        assert tensor.dtype == torch.int64


def test_plan_without_page_offset_keeps_global_ids():
    # request 0 crosses a page: held slot 3 on page 5, slot 4 on page 6
    chosen = [_request(0, 2, 3, [5, 6]), _request(2, 1, 16, [1, 7, 9, 4, 2])]
    plan = chunk_plan(chosen, layer=1, block_size=4, page_offset=0)
    assert plan.tables.tolist() == [[5, 6, 0, 0, 0], [1, 7, 9, 4, 2]]
    assert plan.slots.tolist() == [5 * 4 + 3, 6 * 4 + 0, 2 * 4 + 0]


def test_plan_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="chosen"):
        chunk_plan([], layer=0, block_size=16, page_offset=0)


def test_plan_refuses_rows_past_the_allocated_pages():
    # request 0's third new row needs a second page its table lacks: an error, not a slot on
    # the padding's page 0
    chosen = [_request(0, 3, 2, [5]), _request(3, 1, 0, [6, 7])]
    with pytest.raises(ValueError, match="block_table"):
        chunk_plan(chosen, layer=1, block_size=4, page_offset=0)
