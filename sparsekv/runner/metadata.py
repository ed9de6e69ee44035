"""Per-step attention metadata, built once per step from the ``SchedulerOutput``.

The model never sees requests; it calls ``PagedAttention.attend(layer, q, k, v)`` on a flattened
ragged batch. This module precomputes, per layer, which token rows take the batched decode path
(one new token: plain decodes, and decodes whose layer then compacts by decode-time eviction)
and the tensors that path needs (block tables, slot counts, slot mapping), and which requests
take the general path (prefill chunks, including prefill chunks that compress).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import torch

from sparsekv.compression.base import Compressor
from sparsekv.kv_cache.manager import LayerStep
from sparsekv.kv_cache.request_kv import RequestKV
from sparsekv.runner.block_tables import (
    BlockTableCache,
    layer_tensors,
    padded_tables,
    slot_counts,
)


@dataclass
class RequestSlice:
    """One request's rows in the flattened batch and its KV plan.

    Attributes:
        request_id: the request.
        start: first row of its tokens in the batch.
        num_new: rows (new tokens).
        layers: per-layer plan from the KV manager.
        kv: the request's KV state (recent queries and H2O accumulators live there).
        compressor: the request's compressor, or ``None``.
        window: observation window of its policy.
        generator: the request's random stream (compressors that evict randomly).
        draft_mass: only a verifying request whose compressor needs attention mass: per
            layer, the attention mass of each of the step's rows
            (``[num_kv_heads, num_held + row + 1]``), so that the rows of rejected draft
            tokens can be taken back out (``spec_decode.rollback``).
        segments: lengths of the reconstruction segments whose rows follow the ``num_new``
            token rows (KVzip, at the prefill step that compresses); their K/V are attended
            in the step and never cached.
        first_layer_scores: ``[num_kv_heads, n]`` fp32 scores of the first layer that
            compressed the request in this step, when its policy ranks every layer by them
            (``runner.layer_scores``).
        reconstruction_until: with ``segments``, the last layer whose compression reads the
            reconstruction rows (``runner.layer_scores.last_reconstruction_layer``); the
            rows leave the forward after it (``PagedAttention.rows_after``).
    """

    request_id: str
    start: int
    num_new: int
    layers: list[LayerStep]
    kv: RequestKV
    compressor: Compressor | None
    window: int
    generator: torch.Generator | None = None
    draft_mass: dict[int, list[torch.Tensor]] | None = None
    segments: tuple[int, ...] = ()
    first_layer_scores: torch.Tensor | None = None
    reconstruction_until: int | None = None

    @property
    def num_rows(self) -> int:
        """Rows of the request in the flattened batch: its new tokens and reconstruction rows."""
        return self.num_new + sum(self.segments)

    @property
    def needs_attention_mass(self) -> bool:
        """The compressor scores with accumulated attention mass (its capability)."""
        return self.compressor is not None and self.compressor.needs_attention_mass


@dataclass
class DecodeBatch:
    """The batched decode path of one layer.

    Attributes:
        slices: requests on this path, in row order of ``rows``.
        rows: ``[batch]`` int64 row of each request's new token in the flattened batch.
        slot_mapping: ``[batch]`` int64 physical slot where the new K/V go.
        block_tables: ``[batch, max_blocks]`` int64 (padded with page 0, masked).
        seq_lens: ``[batch]`` int64 logical slot count after the write.
        first_slots: ``[batch]`` int64.
        all_rows: the batch's rows are the step's every row, in order (a decode-only step
            without compaction groups): the layer reads and writes ``q``/``k``/``v`` and its
            output whole, without gathering rows.
        need_mass: some request on the path accumulates attention mass.
        budgeted: some request's layer state keeps a budget (recent queries to remember).
        compacting: the requests of ``slices`` whose layer compacts after the forward.
    """

    slices: list[RequestSlice]
    rows: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    first_slots: torch.Tensor
    all_rows: bool = False
    need_mass: bool = False
    budgeted: bool = True
    compacting: list[RequestSlice] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, passed to the model as an argument.

    Attributes:
        slices: every request of the step in batch order.
        decode: per layer, the batched decode path (``None`` when no request takes it).
        general: per layer, the requests on the general path.
        num_tokens: rows of the flattened batch.
    """

    slices: list[RequestSlice]
    decode: list[DecodeBatch | None]
    general: list[list[RequestSlice]]
    num_tokens: int


def physical_slots(block_table: list[int], offsets: range, block_size: int) -> list[int]:
    """Physical slots ``page * block_size + offset`` of held-slot offsets of one layer."""
    table = block_table
    return [table[o // block_size] * block_size + o % block_size for o in offsets]


def build_metadata(
    slices: list[RequestSlice],
    num_layers: int,
    block_size: int,
    device: torch.device,
    tables_cache: BlockTableCache | None = None,
) -> AttentionMetadata:
    """Split each layer's requests between the decode and general paths and build tensors.

    Layers whose decode path holds the same requests (all of them, in a step without
    compaction) share one build: their tensors are stacked ``[num_layers, ...]`` and each
    layer's ``DecodeBatch`` views its row, so a step costs a handful of tensor creations,
    not five per layer. ``tables_cache`` (the runner's) keeps the block tables between steps.
    """
    if tables_cache is not None:
        tables_cache.start_step()
    decode: list[DecodeBatch | None] = [None] * num_layers
    num_tokens = sum(s.num_rows for s in slices)
    on_decode = [_decode_layers(s) for s in slices]
    if all(flags is True for flags in on_decode):
        # Every request decodes in every layer (any decode-only step): one group, no scan.
        general: list[list[RequestSlice]] = [[] for _ in range(num_layers)]
        groups = {tuple(range(len(slices))): list(range(num_layers))} if slices else {}
    else:
        general, groups = _split_layers(slices, on_decode, num_layers)
    for members, layers in groups.items():
        batch_slices = [slices[i] for i in members]
        all_rows = len(members) == num_tokens and all(
            s.start == i for i, s in enumerate(batch_slices)
        )
        batches = _decode_batches(batch_slices, layers, block_size, device, all_rows, tables_cache)
        for layer, batch in zip(layers, batches):
            decode[layer] = batch
    return AttentionMetadata(slices, decode, general, num_tokens)


def _decode_layers(request: RequestSlice) -> bool | list[bool]:
    """Which layers take ``request`` on the decode path: ``True`` for all of them (one new
    token, and no layer compresses but by decode-time eviction), else one flag per layer
    (head-wise layers take the general path: ``runner.headwise``)."""
    if request.num_rows != 1:
        return [False] * len(request.layers)
    flags = [
        (step.compress_to is None or step.decode_compaction) and step.head_lens is None
        for step in request.layers
    ]
    return True if all(flags) else flags


def _split_layers(
    slices: list[RequestSlice], on_decode: list[bool | list[bool]], num_layers: int
) -> tuple[list[list[RequestSlice]], dict[tuple[int, ...], list[int]]]:
    """Per layer, the requests on the general path, and the layers grouped by the requests on
    their decode path (``on_decode``: ``_decode_layers`` of each request)."""
    general: list[list[RequestSlice]] = []
    groups: dict[tuple[int, ...], list[int]] = {}
    for layer in range(num_layers):
        members = tuple(i for i, flags in enumerate(on_decode) if flags is True or flags[layer])
        if len(members) == len(slices):
            general.append([])
        else:
            chosen = set(members)
            general.append([s for i, s in enumerate(slices) if i not in chosen])
        if members:
            groups.setdefault(members, []).append(layer)
    return general, groups


def _decode_batches(
    slices: list[RequestSlice],
    layers: list[int],
    block_size: int,
    device: torch.device,
    all_rows: bool,
    tables_cache: BlockTableCache | None,
) -> list[DecodeBatch]:
    """One ``DecodeBatch`` per layer of ``layers``, all over the same ``slices``."""
    steps = [s.layers[layer] for layer in layers for s in slices]  # layer-major
    page_lists = [step.block_table for step in steps]
    held = np.fromiter(map(_num_held, steps), dtype=np.int64, count=len(steps))
    first = np.fromiter(map(_first_slot, steps), dtype=np.int64, count=len(steps))
    shape = (len(layers), len(slices))
    if tables_cache is not None and tables_cache.device == device:
        tensors = tables_cache.tensors(page_lists, held, first, shape, block_size)
    else:
        tables = padded_tables(page_lists)  # [L * B, max_blocks]
        tensors = layer_tensors(tables, slot_counts(tables, held, first, block_size), shape, device)
    rows = torch.tensor([s.start for s in slices], dtype=torch.long, device=device)
    need_mass = any(s.needs_attention_mass for s in slices)
    compacting = _compacting(slices, steps, len(layers))
    return [
        DecodeBatch(
            slices=slices,
            rows=rows,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            first_slots=first_slots,
            all_rows=all_rows,
            need_mass=need_mass,
            budgeted=any(s.kv.layers[layer].budget is not None for s in slices),
            compacting=layer_compacting,
        )
        for layer, layer_compacting, (block_tables, slot_mapping, seq_lens, first_slots) in zip(
            layers, compacting, tensors
        )
    ]


_num_held = attrgetter("num_held")
_first_slot = attrgetter("first_slot")
_decode_compaction = attrgetter("decode_compaction")


def _compacting(
    slices: list[RequestSlice], steps: list[LayerStep], num_layers: int
) -> list[list[RequestSlice]]:
    """Per layer, the requests of ``slices`` whose layer compacts after the forward (``steps``:
    their ``LayerStep``s, layer-major); one C-level scan finds the usual none."""
    flags = list(map(_decode_compaction, steps))
    if not any(flags):
        return [[] for _ in range(num_layers)]
    width = len(slices)
    return [
        list(itertools.compress(slices, flags[i * width : (i + 1) * width]))
        for i in range(num_layers)
    ]
