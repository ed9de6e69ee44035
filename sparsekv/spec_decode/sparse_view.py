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
    """One request's row in a draft forward.

    Attributes:
        kv: the request's KV state.
        layers: its verification step's per-layer plans (their tables cover the draft slots).
        index: the draft position ``j`` (its K/V go to held slot ``num_held + j``).
        sink_tokens: the request's ``draft_sink_tokens``.
        recent_tokens: the request's ``draft_recent_tokens``.
    """

    kv: RequestKV
    layers: list[LayerStep]
    index: int
    sink_tokens: int
    recent_tokens: int


class DraftAttention:
    """The attention context of one draft forward (an argument of the model's forward, like
    ``runner.paged_attention.PagedAttention``): one row per drafting request, each layer one
    batched paged decode over the rows' views.

    Args:
        storages: the page storage of every layer.
        layer_specs: per-layer cache spec (sliding windows).
        rows: the forward's rows, in batch order.
        block_size: slots per page.
        device: where the tables go.
        logit_softcap: the model's attention logit soft-cap, or ``None``.

    Attributes:
        view_slots: per layer attended, the slots the rows' views hold (bytes-read figures).
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
        self.view_slots: dict[int, int] = {}

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write the rows' new K/V into their draft slots and attend over the views.

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
        slots, tables, seq_lens, first_slots = self._tables(layer, window)
        storage = self.storages[layer]
        states = [row.kv.layers[layer] for row in self.rows]
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

    def _tables(self, layer: int, window: int | None) -> tuple[torch.Tensor, ...]:
        """``slot_mapping``, ``block_tables``, ``seq_lens``, ``first_slots`` of one layer."""
        bs = self.block_size
        slots, tables, seq_lens, first_slots = [], [], [], []
        num_read = 0
        for row in self.rows:
            step = row.layers[layer]
            held = step.num_held + row.index  # the draft slot, relative to first_slot
            slots.append(step.block_table[held // bs] * bs + held % bs)
            if window is not None:
                tables.append(step.block_table[: held // bs + 1])
                seq_lens.append(step.first_slot + held + 1)
                first_slots.append(step.first_slot)
                num_read += min(window, held + 1)
                continue
            pages, num_slots = view_table(
                step.block_table, held + 1, bs, row.sink_tokens, row.recent_tokens
            )
            tables.append(pages)
            seq_lens.append(num_slots)
            first_slots.append(0)
            num_read += num_slots
        self.view_slots[layer] = num_read
        arrays = (np.array(slots), padded_tables(tables), np.array(seq_lens), np.array(first_slots))
        return tuple(torch.from_numpy(a.astype(np.int64)).to(self.device) for a in arrays)
