"""The decode path's block-table and slot-count tensors, and their cache between steps.

``runner.metadata`` builds each decode group's tensors here: the ``[layers * requests,
longest]`` block tables padded with page 0, the slot counts (new token's physical slot, slot
count after its write, first slot) and per-layer views of both. ``BlockTableCache`` keeps them
between steps and rewrites only what changed: on CPU the tensors are views of its host arrays;
on an accelerator they are persistent device tensors that take only the changed rows from a
pinned host mirror, with non-blocking copies.
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
    """The decode path's tensors, kept between steps (one cache per model runner).

    Most decode steps change few pages of few (request, layer) tables, and a 16-request
    SmolLM2 step has 480 tables of 65-133 pages: rather than converting ~50k page ids per
    step, the cache keeps each decode group's padded tables and copies of the lists it
    converted, and rewrites only the rows whose list differs by value (compaction, preemption
    and the prefix cache may edit a list in place or replace it; a new batch composition just
    differs in more rows). The slot counts are written into a kept array too, so the per-layer
    tensors (views of both) are made again only when a group's shape or width changes.

    With ``mirror`` (the default off CPU) the host arrays are a mirror (pinned on CUDA) of
    persistent tensors on ``device``: the rewritten rows go to the device in one
    ``non_blocking`` copy per run of consecutive rows, the slot counts in one copy per step,
    and the tables are allocated a power-of-two width of pages (zero padded, masked by the
    kernels) so that a request crossing into a new page does not reallocate them. On CPU
    without ``mirror`` the tensors are views of the host arrays, at the longest table's width.

    The arrays are reused: the tensors of a step's metadata are valid until the next
    ``build_metadata`` with this cache (the runner builds and runs one step at a time). A
    non-blocking copy reads the host mirror after the call returns: the next step waits for
    the event recorded after it (``HostFence``) before it rewrites the mirror.

    Args:
        device: where the tensors live.
        mirror: keep separate device tensors fed by copies (``None``: off on CPU, on
            elsewhere); on CPU it exercises the device route in tests.

    Attributes:
        rows_copied: table rows copied host to device so far (``mirror`` only).
    """

    def __init__(self, device: torch.device | None = None, mirror: bool | None = None) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.mirror = self.device.type != "cpu" if mirror is None else mirror
        self.rows_copied = 0
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
        """The step's next decode group's per-layer tensors on ``device``, with the values
        ``layer_tensors`` of ``padded_tables`` and ``slot_counts`` gives (wider tables with
        ``mirror``: the extra columns are page 0).

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
            group = _CachedGroup(shape, page_lists, self.mirror)
            self._groups[index : index + 1] = [group]
            changed = range(len(page_lists))
        else:
            changed = group.update(page_lists)
        slot_counts(group.padded, held, first, block_size, out=group.counts)
        if not self.mirror:
            if group.tensors is None:
                group.tensors = layer_tensors(group.padded, group.counts, shape, self.device)
            return group.tensors
        if group.tensors is None:
            group.allocate_device(self.device)
            changed = range(len(page_lists))
        self.rows_copied += group.copy_rows(changed)
        return group.tensors


class _CachedGroup:
    """One decode group's arrays in a ``BlockTableCache``.

    Attributes:
        shape: (layers, requests).
        copies: the page lists ``padded`` holds, layer-major.
        padded: ``[L * B, width]`` int64 tables padded with page 0 (``width``: the longest
            table's, or with ``mirror`` a power of two at least that).
        counts: ``[3, L * B]`` int64 (``slot_counts``), rewritten every step.
        tensors: per-layer views of ``padded`` and ``counts`` (``mirror``: of their device
            copies); ``None`` after ``padded`` was replaced.
    """

    def __init__(self, shape: tuple[int, int], page_lists: list[list[int]], mirror: bool) -> None:
        self.shape = shape
        self.mirror = mirror
        self.copies = [list(table) for table in page_lists]
        tables = padded_tables(page_lists)
        if mirror:
            tables = _rewidened(tables, _width(tables.shape[1], mirror), mirror)
        self.padded = tables
        self.counts = _host_array((3, len(page_lists)), mirror)
        self.tensors: list[LayerTensors] | None = None
        self._device_tables: torch.Tensor | None = None
        self._device_counts: torch.Tensor | None = None
        self.fence = HostFence()

    def update(self, page_lists: list[list[int]]) -> list[int]:
        """Rewrite the rows whose list changed (a new array when the longest one outgrew the
        width, or without ``mirror`` changed it); returns the rewritten rows."""
        self.fence.wait()
        if page_lists == self.copies:
            return []
        longest = max(map(len, page_lists))
        width = self.padded.shape[1]
        if longest > width or (not self.mirror and longest != width):
            self.padded = _rewidened(self.padded, _width(longest, self.mirror), self.mirror)
            self.tensors = None
        padded, copies = self.padded, self.copies
        changed = []
        for i, (table, copy) in enumerate(zip(page_lists, copies)):
            if table != copy:
                padded[i, : len(table)] = table
                padded[i, len(table) :] = 0
                copies[i] = list(table)
                changed.append(i)
        return changed

    def allocate_device(self, device: torch.device) -> None:
        """Fresh device tensors of the host arrays' shapes and their per-layer views."""
        self._device_tables = torch.empty(self.padded.shape, dtype=torch.int64, device=device)
        self._device_counts = torch.empty(self.counts.shape, dtype=torch.int64, device=device)
        self.tensors = _layer_views(self._device_tables, self._device_counts, self.shape)

    def copy_rows(self, rows) -> int:
        """Copy the table ``rows`` (ascending) and every slot count to the device, one
        non-blocking copy per run of consecutive rows; returns the rows copied."""
        host_tables = torch.from_numpy(self.padded)
        for start, stop in row_runs(rows):
            target = self._device_tables[start:stop]
            target.copy_(host_tables[start:stop], non_blocking=True)
        self._device_counts.copy_(torch.from_numpy(self.counts), non_blocking=True)
        self.fence.record(self._device_counts.device)
        return len(rows)


class HostFence:
    """Guards a host mirror that non-blocking copies read: ``record`` after enqueuing the
    copies, ``wait`` before writing the mirror again (a no-op unless a CUDA copy is pending)."""

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None

    def record(self, device: torch.device) -> None:
        """Mark the copies enqueued so far on ``device``'s current stream."""
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Block until the recorded copies have read the mirror."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def _layer_views(tables: torch.Tensor, counts: torch.Tensor, shape) -> list[LayerTensors]:
    """Per layer, views of ``[L * B, width]`` tables and ``[3, L * B]`` counts."""
    slot_t, seq_t, first_t = counts.view(3, *shape)
    return list(zip(tables.view(*shape, -1).unbind(0), slot_t, seq_t, first_t))


def row_runs(rows) -> list[tuple[int, int]]:
    """Ascending row indices -> ``[start, stop)`` runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def _width(longest: int, mirror: bool) -> int:
    """Table columns for a longest table of ``longest`` pages."""
    if not mirror:
        return longest
    return 1 << max(3, (longest - 1).bit_length())


def _host_array(shape: tuple[int, ...], mirror: bool) -> np.ndarray:
    """An int64 host array; with ``mirror`` on a CUDA machine, a view of pinned memory (what
    makes a host-to-device copy asynchronous)."""
    pin = mirror and torch.cuda.is_available()
    return torch.empty(shape, dtype=torch.int64, pin_memory=pin).numpy()


def _rewidened(padded: np.ndarray, width: int, mirror: bool = False) -> np.ndarray:
    """``padded`` cut or zero-extended to ``width`` columns (a fresh array)."""
    wider = _host_array((padded.shape[0], width), mirror)
    keep = min(width, padded.shape[1])
    wider[:, :keep] = padded[:, :keep]
    wider[:, keep:] = 0
    return wider
