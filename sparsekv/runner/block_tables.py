"""The decode path's block-table and slot-count tensors, and their cache between steps.

``runner.metadata`` builds each decode group's tensors here: the ``[layers * requests,
longest]`` block tables padded with page 0, the slot counts (new token's physical slot, slot
count after its write, first slot) and per-layer views of both. ``BlockTableCache`` keeps them
between steps and rewrites only what changed.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

# One layer's decode tensors: block tables, slot mapping, slot counts, first slots.
LayerTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def slot_counts(
    tables: np.ndarray,
    held: np.ndarray,
    first: np.ndarray,
    block_size: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``[3, L * B]`` int64: the physical slot of each new token, the slot count after its
    write, the first slot (``tables`` ``[L * B, max_blocks]``, ``held`` and ``first`` the
    layers' held and first slots)."""
    pages = tables[np.arange(len(held)), held // block_size]  # the page the new token goes to
    return np.stack([pages * block_size + held % block_size, first + held + 1, first], out=out)


def layer_tensors(
    tables: np.ndarray, counts: np.ndarray, shape: tuple[int, int], device: torch.device
) -> list[LayerTensors]:
    """Per layer, views of the ``[L, B, ...]`` tensors of ``tables`` and ``counts``."""
    tables_t = torch.from_numpy(tables.reshape(*shape, -1)).to(device)
    slot_t, seq_t, first_t = torch.from_numpy(counts.reshape(3, *shape)).to(device)
    return list(zip(tables_t.unbind(0), slot_t.unbind(0), seq_t.unbind(0), first_t.unbind(0)))


def padded_tables(page_lists: list[list[int]]) -> np.ndarray:
    """``[len(page_lists), longest]`` int64 block tables, padded with page 0 (masked by the
    kernels), converted in one pass."""
    lengths = np.fromiter(map(len, page_lists), dtype=np.int64, count=len(page_lists))
    flat = itertools.chain.from_iterable(page_lists)
    pages = np.fromiter(flat, dtype=np.int64, count=int(lengths.sum()))
    padded = np.zeros((len(page_lists), int(lengths.max())), dtype=np.int64)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = pages
    return padded


class BlockTableCache:
    """The CPU decode path's tensors, kept between steps (one cache per model runner).

    Most decode steps change few pages of few (request, layer) tables, and a 16-request
    SmolLM2 step has 480 tables of 65-133 pages: rather than converting ~50k page ids per
    step, the cache keeps each decode group's padded tables and copies of the lists it
    converted, and rewrites only the rows whose list differs by value (compaction, preemption
    and the prefix cache may edit a list in place or replace it; a new batch composition just
    differs in more rows). The slot counts are written into a kept array too, so the per-layer
    tensors (views of both) are made again only when a group's shape or width changes.

    The arrays are reused: the tensors of a step's metadata are valid until the next
    ``build_metadata`` with this cache (the runner builds and runs one step at a time).
    """

    def __init__(self) -> None:
        self._groups: list[_CachedGroup] = []
        self._next = 0

    def start_step(self) -> None:
        """Begin a step: its decode groups take the cached groups in order; the groups no
        decode group of the previous step used are dropped."""
        del self._groups[self._next :]
        self._next = 0

    def tensors(
        self,
        page_lists: list[list[int]],
        held: np.ndarray,
        first: np.ndarray,
        shape: tuple[int, int],
        block_size: int,
    ) -> list[LayerTensors]:
        """The step's next decode group's per-layer CPU tensors, as ``layer_tensors`` of
        ``padded_tables`` and ``slot_counts`` makes them.

        Args:
            page_lists: the group's block tables, layer-major (``shape[0]`` layers of
                ``shape[1]`` requests).
            held, first: ``[L * B]`` held and first slots of those layers.
            shape: (layers, requests).
            block_size: slots per page.
        """
        index, self._next = self._next, self._next + 1
        group = self._groups[index] if index < len(self._groups) else None
        if group is None or group.shape != shape:
            group = _CachedGroup(shape, page_lists)
            self._groups[index : index + 1] = [group]
        else:
            group.update(page_lists)
        slot_counts(group.padded, held, first, block_size, out=group.counts)
        if group.tensors is None:
            cpu = torch.device("cpu")
            group.tensors = layer_tensors(group.padded, group.counts, shape, cpu)
        return group.tensors


class _CachedGroup:
    """One decode group's arrays in a ``BlockTableCache``.

    Attributes:
        shape: (layers, requests).
        copies: the page lists ``padded`` holds, layer-major.
        padded: ``[L * B, longest]`` int64 tables padded with page 0.
        counts: ``[3, L * B]`` int64 (``slot_counts``), rewritten every step.
        tensors: per-layer views of ``padded`` and ``counts``; ``None`` after ``padded`` was
            replaced.
    """

    def __init__(self, shape: tuple[int, int], page_lists: list[list[int]]) -> None:
        self.shape = shape
        self.copies = [list(table) for table in page_lists]
        self.padded = padded_tables(page_lists)
        self.counts = np.empty((3, len(page_lists)), dtype=np.int64)
        self.tensors: list[LayerTensors] | None = None

    def update(self, page_lists: list[list[int]]) -> None:
        """Rewrite the rows whose list changed (a new array when the longest one did)."""
        if page_lists == self.copies:
            return
        longest = max(map(len, page_lists))
        if longest != self.padded.shape[1]:
            self.padded = _rewidened(self.padded, longest)
            self.tensors = None
        padded, copies = self.padded, self.copies
        for i, (table, copy) in enumerate(zip(page_lists, copies)):
            if table != copy:
                padded[i, : len(table)] = table
                padded[i, len(table) :] = 0
                copies[i] = list(table)


def _rewidened(padded: np.ndarray, width: int) -> np.ndarray:
    """``padded`` cut or zero-extended to ``width`` columns (a fresh array)."""
    wider = np.zeros((padded.shape[0], width), dtype=np.int64)
    keep = min(width, padded.shape[1])
    wider[:, :keep] = padded[:, :keep]
    return wider
