"""The draft view of sparse self-speculation: a subset of a request's own pages, and the
attention context a draft forward runs in.

The draft is the target model itself reading a StreamingLLM-like view of its own cache (Xiao
et al., 2024, "Efficient Streaming Language Models with Attention Sinks"; the self-drafting of
TriForce, Sun et al., 2024, and MagicDec, Chen et al., 2024): per layer the pages holding the
first ``draft_sink_tokens`` slots and those holding the last ``draft_recent_tokens`` slots.
A view is a block table over pages the layer already holds, so it costs no copy: the kernels
read its slots in table order (a key's position lives in its post-RoPE value, not in its slot),
and the partial last page stays last. Sliding-window layers read their own window instead.

A draft forward writes each layer's new K/V into the slot the verification step computes next
(held slot ``num_held + j`` for the ``j``-th draft position), so the drafts' own earlier
positions are part of the recent pages; the verification overwrites those slots. It logs no
window queries, accumulates no attention mass and compacts nothing: the request's side state
and held slots are exactly as before the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparsekv.attention.backends.base import DecodeParams
from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.request_kv import RequestKV
from sparsekv.kv_cache.spec import LayerSpec, cdiv
from sparsekv.kv_cache.storage import KVStorage
from sparsekv.runner.block_tables import padded_tables


def view_table(
    block_table: list[int], num_slots: int, block_size: int, sink_tokens: int, recent_tokens: int
) -> tuple[list[int], int]:
    """The pages of a layer's draft view and the view's slot count.

    The view holds the pages of held slots ``[0, sink_tokens)`` (rounded up to whole pages)
    and of ``[num_slots - recent_tokens, num_slots)`` (back to a page start), the last held
    slot always included; the whole table when the two parts meet.

    Args:
        block_table: the layer's page ids (at least ``ceil(num_slots / block_size)``).
        num_slots: held slots the view is taken over (``first_slot`` 0).
        block_size: slots per page.
        sink_tokens: leading slots kept (>= 0).
        recent_tokens: trailing slots kept (>= 0).

    Returns:
        (page ids, slot count): view slot ``i`` is held slot ``i`` within the sink pages and
        held slot ``recent_start + i - sink_slots`` after them.
    """
    num_pages = cdiv(num_slots, block_size)
    sink_pages = cdiv(sink_tokens, block_size)
    recent_first = max(0, num_slots - max(recent_tokens, 1)) // block_size
    if recent_first <= sink_pages:
        return block_table[:num_pages], num_slots
    pages = block_table[:sink_pages] + block_table[recent_first:num_pages]
    return pages, sink_pages * block_size + num_slots - recent_first * block_size


@dataclass
class DraftRow:
    """One request's row in a step's draft forwards.

    Attributes:
        kv: the request's KV state.
        layers: its verification step's per-layer plans (their tables cover the draft slots).
        num_drafts: draft positions it runs this step (its ``j``-th K/V go to held slot
            ``num_held + j``).
        sink_tokens: the request's ``draft_sink_tokens``.
        recent_tokens: the request's ``draft_recent_tokens``.
    """

    kv: RequestKV
    layers: list[LayerStep]
    num_drafts: int
    sink_tokens: int
    recent_tokens: int


@dataclass
class _LayerTables:
    """One layer's draft tensors for the whole step (rows in batch order)."""

    slots: torch.Tensor  # [rows, max drafts] int64 pool slot of draft position j
    tables: torch.Tensor  # [rows, pages] int64 view pages, covering every draft slot
    # [rows, max drafts] int64 the kernel's length at draft position j: view slots, or for a
    # sliding layer the logical length first_slot + held + 1 + j (the window bounds the read)
    seq_lens: torch.Tensor
    first_slots: torch.Tensor  # [rows] int64
    num_read: np.ndarray  # [rows, max drafts] slots each row reads at draft position j


class DraftAttention:
    """The attention context of a step's draft forwards (an argument of the model's forward,
    like ``runner.paged_attention.PagedAttention``): one row per drafting request, each layer
    one batched paged decode over the rows' views.

    Draft forward ``j`` (:meth:`begin`) runs the rows with more than ``j`` drafts. A layer's
    tables are built once per step, at its first draft forward: the view is that of draft
    position 0 (its recent part reaching back to a page start) and position ``j`` reads it
    plus the ``j`` draft slots written since: the recent part does not slide within a step.

    Args:
        storages: the page storage of every layer.
        layer_specs: per-layer cache spec (sliding windows).
        rows: the step's drafting rows, in batch order.
        block_size: slots per page.
        device: where the tables go.
        logit_softcap: the model's attention logit soft-cap, or ``None``.

    Attributes:
        index: the current draft position ``j``.
    """

    def __init__(
        self,
        storages: list[KVStorage],
        layer_specs: list[LayerSpec],
        rows: list[DraftRow],
        block_size: int,
        device: torch.device,
        logit_softcap: float | None = None,
    ) -> None:
        self.storages = storages
        self.layer_specs = layer_specs
        self.rows = rows
        self.block_size = block_size
        self.device = device
        self.logit_softcap = logit_softcap
        self._layers: dict[int, _LayerTables] = {}
        self._attended: list[int] = []  # layers of the current draft forward
        self.index = 0
        self._picked = list(range(len(rows)))
        self._active: list[DraftRow] = list(rows)
        self._active_rows: torch.Tensor | None = None  # None: every row

    def begin(self, index: int) -> list[int]:
        """Start draft forward ``index``.

        Returns:
            Indices into ``rows`` of the rows it runs (those with more than ``index``
            drafts), in the forward's batch order.
        """
        self.index = index
        self._picked = [i for i, row in enumerate(self.rows) if row.num_drafts > index]
        self._active = [self.rows[i] for i in self._picked]
        full = len(self._picked) == len(self.rows)
        self._active_rows = None if full else torch.tensor(self._picked, device=self.device)
        self._attended = []
        return self._picked

    @property
    def view_slots(self) -> dict[int, int]:
        """Per layer attended in the current draft forward, the slots its rows read (the
        window-capped count on sliding layers): bytes-read figures."""
        return {
            layer: int(self._layers[layer].num_read[self._picked, self.index].sum())
            for layer in self._attended
        }

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write the active rows' new K/V into their draft slots and attend over the views.

        Args:
            layer: layer index.
            q: ``[rows, num_heads, head_dim]`` post-RoPE queries.
            k, v: ``[rows, num_kv_heads, head_dim]`` new keys (post-RoPE) and values.
            scale: softmax scale.
            sliding_window: the model's window for this layer (``PagedAttention.attend``);
                a windowed layer reads its held pages under the window, not a view.

        Returns:
            ``[rows, num_heads, head_dim]`` in the query dtype.
        """
        window = sliding_window
        if window is None:
            window = self.layer_specs[layer].sliding_window
        built = self._layers.get(layer)
        if built is None:
            built = self._layers[layer] = self._build(layer, window)
        slots, tables = built.slots[:, self.index], built.tables
        seq_lens, first_slots = built.seq_lens[:, self.index], built.first_slots
        if self._active_rows is not None:
            picked = self._active_rows
            slots, tables = slots[picked], tables[picked]
            seq_lens, first_slots = seq_lens[picked], first_slots[picked]
        self._attended.append(layer)
        storage = self.storages[layer]
        states = [row.kv.layers[layer] for row in self._active]
        storage.write_decode(slots, states, k, v)
        params = DecodeParams(
            block_tables=tables,
            seq_lens=seq_lens,
            scale=scale,
            first_slots=first_slots,
            sliding_window=window,
            logit_softcap=self.logit_softcap,
        )
        out, _, _ = storage.decode_attention(q, params, states)
        return out

    def _build(self, layer: int, window: int | None) -> _LayerTables:
        """The layer's tensors for every row and draft position of the step."""
        bs = self.block_size
        steps = np.arange(max(row.num_drafts for row in self.rows))  # draft positions j
        slots = np.zeros((len(self.rows), len(steps)), dtype=np.int64)
        tables, first_lens, first_slots, first_reads = [], [], [], []
        for i, row in enumerate(self.rows):
            step = row.layers[layer]
            held = step.num_held  # draft position 0's slot, relative to first_slot
            for j in range(row.num_drafts):
                slot = held + j
                slots[i, j] = step.block_table[slot // bs] * bs + slot % bs
            last_page = cdiv(held + row.num_drafts, bs)  # the page of the last draft slot
            if window is not None:
                tables.append(step.block_table[:last_page])
                first_lens.append(step.first_slot + held + 1)
                first_slots.append(step.first_slot)
                first_reads.append(held + 1)
                continue
            pages, num_slots = view_table(
                step.block_table, held + 1, bs, row.sink_tokens, row.recent_tokens
            )
            tables.append(pages + step.block_table[cdiv(held + 1, bs) : last_page])
            first_lens.append(num_slots)
            first_slots.append(0)
            first_reads.append(num_slots)
        seq_lens = np.array(first_lens)[:, None] + steps  # [rows, max drafts]
        num_read = np.array(first_reads)[:, None] + steps
        if window is not None:
            num_read = np.minimum(num_read, window)
        arrays = (slots, padded_tables(tables), seq_lens, np.array(first_slots))
        slots_t, tables_t, lens_t, firsts_t = (
            torch.from_numpy(a.astype(np.int64)).to(self.device) for a in arrays
        )
        return _LayerTables(slots_t, tables_t, lens_t, firsts_t, num_read)
