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

import numpy as np
import torch

from sparsekv.compression.base import Compressor
from sparsekv.kv_cache.manager import LayerStep
from sparsekv.kv_cache.request_kv import RequestKV


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
        generator: random source for the ``random`` compressor.
    """

    request_id: str
    start: int
    num_new: int
    layers: list[LayerStep]
    kv: RequestKV
    compressor: Compressor | None
    window: int
    generator: torch.Generator | None = None

    @property
    def needs_attention_mass(self) -> bool:
        return self.compressor is not None and self.compressor.name == "h2o"


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
        need_mass: some request on the path accumulates attention mass (H2O).
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
    slices: list[RequestSlice], num_layers: int, block_size: int, device: torch.device
) -> AttentionMetadata:
    """Split each layer's requests between the decode and general paths and build tensors.

    Layers whose decode path holds the same requests (all of them, in a step without
    compaction) share one build: their tensors are stacked ``[num_layers, ...]`` and each
    layer's ``DecodeBatch`` views its row, so a step costs a handful of tensor creations,
    not five per layer.
    """
    decode: list[DecodeBatch | None] = [None] * num_layers
    general: list[list[RequestSlice]] = []
    num_tokens = sum(s.num_new for s in slices)
    groups: dict[tuple[int, ...], list[int]] = {}
    for layer in range(num_layers):
        members = tuple(
            i
            for i, s in enumerate(slices)
            if s.num_new == 1
            and (s.layers[layer].compress_to is None or s.layers[layer].decode_compaction)
        )
        if len(members) == len(slices):
            general.append([])
        else:
            chosen = set(members)
            general.append([s for i, s in enumerate(slices) if i not in chosen])
        if members:
            groups.setdefault(members, []).append(layer)
    for members, layers in groups.items():
        on_decode = [slices[i] for i in members]
        all_rows = len(members) == num_tokens and all(s.start == i for i, s in enumerate(on_decode))
        batches = _decode_batches(on_decode, layers, block_size, device, all_rows)
        for layer, batch in zip(layers, batches):
            decode[layer] = batch
    return AttentionMetadata(slices, decode, general, num_tokens)


def _decode_batches(
    slices: list[RequestSlice],
    layers: list[int],
    block_size: int,
    device: torch.device,
    all_rows: bool,
) -> list[DecodeBatch]:
    """One ``DecodeBatch`` per layer of ``layers``, all over the same ``slices``."""
    steps = [s.layers[layer] for layer in layers for s in slices]  # layer-major
    tables = _padded_tables(slices, tuple(layers)).reshape(len(steps), -1)  # [L * B, max_blocks]
    held = np.fromiter((step.num_held for step in steps), dtype=np.int64, count=len(steps))
    first = np.fromiter((step.first_slot for step in steps), dtype=np.int64, count=len(steps))
    pages = tables[np.arange(len(steps)), held // block_size]  # the page the new token goes to
    counts = np.stack([pages * block_size + held % block_size, first + held + 1, first])
    shape = (len(layers), len(slices))
    tables_t = torch.from_numpy(tables.reshape(*shape, -1)).to(device)
    slot_t, seq_t, first_t = torch.from_numpy(counts.reshape(3, *shape)).to(device)
    rows = torch.tensor([s.start for s in slices], dtype=torch.long, device=device)
    need_mass = any(s.needs_attention_mass for s in slices)
    per_layer = zip(
        layers, tables_t.unbind(0), slot_t.unbind(0), seq_t.unbind(0), first_t.unbind(0)
    )
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
            compacting=[s for s in slices if s.layers[layer].decode_compaction],
        )
        for layer, block_tables, slot_mapping, seq_lens, first_slots in per_layer
    ]


def _padded_tables(slices: list[RequestSlice], layers: tuple[int, ...]) -> np.ndarray:
    """``[len(layers), len(slices), longest]`` int64 block tables, padded with page 0 (masked
    by the kernels).

    A request's tables are converted from their lists only when they differ from the ones it
    had at its previous decode step (``RequestKV.decode_tables``): most steps change few pages
    of few requests, and a 16-request SmolLM2 step has 480 tables of 65-133 pages.
    """
    per_request = [_request_tables(s, layers) for s in slices]
    padded = np.zeros((len(layers), len(slices), max(t.shape[1] for t in per_request)), np.int64)
    for i, tables in enumerate(per_request):
        padded[:, i, : tables.shape[1]] = tables
    return padded


def _request_tables(request: RequestSlice, layers: tuple[int, ...]) -> np.ndarray:
    """``[len(layers), longest]`` int64 tables of one request, from its cache when its lists
    are unchanged (compared by value: compaction, preemption and the prefix cache may edit them
    in place)."""
    tables = [request.layers[layer].block_table for layer in layers]
    cached = request.kv.decode_tables
    if cached is not None and cached[0] == layers and cached[1] == tables:
        return cached[2]
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = itertools.chain.from_iterable(tables)
    pages = np.fromiter(flat, dtype=np.int64, count=int(lengths.sum()))
    padded = np.zeros((len(tables), int(lengths.max())), dtype=np.int64)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = pages
    request.kv.decode_tables = (layers, [list(table) for table in tables], padded)
    return padded
