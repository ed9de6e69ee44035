"""Per-step attention metadata, built once per step from the ``SchedulerOutput``.

The model never sees requests; it calls ``PagedAttention.attend(layer, q, k, v)`` on a flattened
ragged batch. This module precomputes, per layer, which token rows take the batched decode path
(one new token, no compression this step) and the tensors that path needs (block tables, slot
counts, slot mapping), and which requests take the general path (prefill chunks and steps that
compress).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    slices: list[RequestSlice]
    rows: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    first_slots: torch.Tensor


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
    """Split each layer's requests between the decode and general paths and build tensors."""
    decode: list[DecodeBatch | None] = []
    general: list[list[RequestSlice]] = []
    num_tokens = sum(s.num_new for s in slices)
    for layer in range(num_layers):
        on_decode = [s for s in slices if s.num_new == 1 and s.layers[layer].compress_to is None]
        on_decode_ids = {id(s) for s in on_decode}
        general.append([s for s in slices if id(s) not in on_decode_ids])
        decode.append(_decode_batch(on_decode, layer, block_size, device) if on_decode else None)
    return AttentionMetadata(slices, decode, general, num_tokens)


def _decode_batch(
    slices: list[RequestSlice], layer: int, block_size: int, device: torch.device
) -> DecodeBatch:
    steps = [s.layers[layer] for s in slices]
    max_blocks = max(len(step.block_table) for step in steps)
    tables = [step.block_table + [0] * (max_blocks - len(step.block_table)) for step in steps]
    slots = [
        physical_slots(step.block_table, range(step.num_held, step.num_held + 1), block_size)[0]
        for step in steps
    ]

    def as_tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return DecodeBatch(
        slices=slices,
        rows=as_tensor([s.start for s in slices]),
        slot_mapping=as_tensor(slots),
        block_tables=as_tensor(tables),
        seq_lens=as_tensor([step.first_slot + step.num_held + 1 for step in steps]),
        first_slots=as_tensor([step.first_slot for step in steps]),
    )
