"""The draft view of sparse self-speculation: which pages it names, and that a draft forward's
attention reads exactly those (a poisoned page outside the view changes nothing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.kv_cache.storage import KVStorage
from sparsekv.spec_decode.sparse_view import DraftAttention, DraftRow, view_table

TABLE = [5, 1, 7, 2, 6, 3]  # 6 pages of 4 slots


@pytest.mark.parametrize(
    ("num_slots", "sink", "recent", "pages", "count"),
    [
        (23, 4, 6, [5, 6, 3], 4 + 7),  # sink page, then the pages of slots 17..22
        (23, 5, 6, [5, 1, 6, 3], 8 + 7),  # the sink rounds up to whole pages
        (23, 4, 0, [5, 3], 4 + 3),  # no recent slots: still the last one's page
        (24, 4, 0, [5, 3], 4 + 4),
        (23, 4, 16, TABLE, 23),  # the parts meet: the whole table
        (9, 4, 4, [5, 1, 7], 9),
        (23, 0, 4, [6, 3], 7),
    ],
)
def test_view_table(num_slots, sink, recent, pages, count):
    assert view_table(TABLE, num_slots, 4, sink, recent) == (pages, count)


def _storage(seed: int) -> KVStorage:
    storage = KVStorage(8, 0, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    storage.tensors[0].copy_(torch.randn(storage.tensors[0].shape, generator=generator))
    return storage


def _slots(storage: KVStorage, held: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_kv_heads, len(held), d]`` K and V of held slots of ``TABLE``."""
    pool = storage.tensors[0]
    keys = torch.stack([pool[TABLE[s // 4], 0, :, s % 4] for s in held], dim=1)
    values = torch.stack([pool[TABLE[s // 4], 1, :, s % 4] for s in held], dim=1)
    return keys, values


def _reference(q, keys, values, scale):
    """Dense attention of ``q`` ``[1, H, d]`` over ``[KVH, n, d]`` (GQA groups of 2)."""
    keys, values = keys.repeat_interleave(2, dim=0), values.repeat_interleave(2, dim=0)
    weights = torch.softmax(torch.einsum("hd,hnd->hn", q[0], keys) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", weights, values)[None]


def test_a_draft_reads_only_its_view_and_writes_the_verification_slot():
    storage = _storage(seed=0)
    for page in (1, 7, 2):  # outside the view of 23 slots with sink 4, recent 6
        storage.tensors[0][page] = float("nan")
    step = LayerStep(block_table=TABLE, first_slot=0, num_held=21, num_new=4)
    kv = SimpleNamespace(layers=[None])
    row = DraftRow(kv=kv, layers=[step], num_drafts=2, sink_tokens=4, recent_tokens=6)
    ctx = DraftAttention([storage], [LayerSpec()], [row], 4, torch.device("cpu"))
    assert ctx.begin(1) == [0]
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 8, generator=generator)
    k, v = torch.randn(2, 1, 2, 8, generator=generator)
    out = ctx.attend(0, q, k, v, scale=0.35)
    # The new K/V sit in held slot 22 (page 3, offset 2), the slot verification overwrites.
    torch.testing.assert_close(storage.tensors[0][3, 0, :, 2], k[0])
    torch.testing.assert_close(storage.tensors[0][3, 1, :, 2], v[0])
    keys, values = _slots(storage, [0, 1, 2, 3, *range(16, 23)])
    torch.testing.assert_close(out, _reference(q, keys, values, 0.35), atol=1e-5, rtol=1e-5)
    assert ctx.view_slots == {0: 11}


def test_a_sliding_layer_reads_its_window():
    storage = _storage(seed=2)
    step = LayerStep(block_table=TABLE, first_slot=0, num_held=18, num_new=3)
    row = DraftRow(kv=SimpleNamespace(layers=[None]), layers=[step], num_drafts=1,
                   sink_tokens=0, recent_tokens=0)  # fmt: skip
    spec = LayerSpec(kind="sliding", sliding_window=6)
    ctx = DraftAttention([storage], [spec], [row], 4, torch.device("cpu"))
    ctx.begin(0)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 8, generator=generator)
    k, v = torch.randn(2, 1, 2, 8, generator=generator)
    out = ctx.attend(0, q, k, v, scale=0.35)
    keys, values = _slots(storage, list(range(13, 19)))  # the new slot 18 and the 5 before
    torch.testing.assert_close(out, _reference(q, keys, values, 0.35), atol=1e-5, rtol=1e-5)
    assert ctx.view_slots == {0: 6}


def test_one_context_serves_every_draft_forward_of_the_step():
    """Tables are built once: a row's later draft positions read the first position's view plus
    the draft slots written since (here across a page boundary), and a row with fewer drafts
    leaves the batch."""
    storage = _storage(seed=4)
    for page in (1, 7):  # outside both views
        storage.tensors[0][page] = float("nan")
    long_row = DraftRow(
        kv=SimpleNamespace(layers=[None]),
        layers=[LayerStep(block_table=TABLE, first_slot=0, num_held=18, num_new=4)],
        num_drafts=3,
        sink_tokens=4,
        recent_tokens=6,
    )
    short_table = [4, 0, 5, 6]  # a second request's pages (5, 6 shared read-only: no matter)
    short_row = DraftRow(
        kv=SimpleNamespace(layers=[None]),
        layers=[LayerStep(block_table=short_table, first_slot=0, num_held=6, num_new=2)],
        num_drafts=1,
        sink_tokens=4,
        recent_tokens=6,
    )
    ctx = DraftAttention([storage], [LayerSpec()], [long_row, short_row], 4, torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    for j, rows, read in ((0, 2, 11 + 7), (1, 1, 12), (2, 1, 13)):
        assert ctx.begin(j) == [0, 1][:rows]
        q = torch.randn(rows, 4, 8, generator=generator)
        k, v = torch.randn(2, rows, 2, 8, generator=generator)
        out = ctx.attend(0, q, k, v, scale=0.35)
        slot = 18 + j  # the long row's draft slot: pages 6 (16..19), then 3 (20..23)
        torch.testing.assert_close(storage.tensors[0][TABLE[slot // 4], 0, :, slot % 4], k[0])
        # View of 19 slots: sink page 5 (0..3), recent pages from slot 12 (page 2) on.
        keys, values = _slots(storage, [0, 1, 2, 3, *range(12, slot + 1)])
        torch.testing.assert_close(out[:1], _reference(q[:1], keys, values, 0.35), atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
        if rows == 2:  # the short row: its 7 slots are its whole table (pages 4, 0)
            pool = storage.tensors[0]
            held = [pool[short_table[s // 4], :, :, s % 4] for s in range(7)]
            keys, values = (torch.stack([h[i] for h in held], dim=1) for i in (0, 1))
            torch.testing.assert_close(out[1:], _reference(q[1:], keys, values, 0.35),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip
        assert ctx.view_slots == {0: read}


def test_a_sliding_layer_reads_its_window_at_every_draft_position():
    """Three drafts from held slot 14 (pages 2, then 3 from slot 16): each position reads the 6
    slots up to its own, across the page boundary."""
    storage = _storage(seed=6)
    storage.tensors[0][5] = float("nan")  # slots 0..3: outside every window
    step = LayerStep(block_table=TABLE, first_slot=0, num_held=14, num_new=4)
    row = DraftRow(kv=SimpleNamespace(layers=[None]), layers=[step], num_drafts=3,
                   sink_tokens=0, recent_tokens=0)  # fmt: skip
    spec = LayerSpec(kind="sliding", sliding_window=6)
    ctx = DraftAttention([storage], [spec], [row], 4, torch.device("cpu"))
    generator = torch.Generator().manual_seed(7)
    for j in range(3):
        assert ctx.begin(j) == [0]
        q = torch.randn(1, 4, 8, generator=generator)
        k, v = torch.randn(2, 1, 2, 8, generator=generator)
        out = ctx.attend(0, q, k, v, scale=0.35)
        slot = 14 + j
        torch.testing.assert_close(storage.tensors[0][TABLE[slot // 4], 1, :, slot % 4], v[0])
        keys, values = _slots(storage, list(range(slot - 5, slot + 1)))
        torch.testing.assert_close(out, _reference(q, keys, values, 0.35), atol=1e-5, rtol=1e-5)
        assert ctx.view_slots == {0: 6}
