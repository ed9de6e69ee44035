"""The act half's last move: apply a finished step to a request's layers.

After a step ran, each layer's slot count grows by the tokens it wrote, shrinks to its budget
where the step compressed it (the evicted count grows by the difference), swaps in its
compaction table, releases the leading pages a sliding window no longer sees, and returns the
pages past its last held slot. Head-wise layers (Ada-KV, ``head_pages``) keep one length per
KV head instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sparsekv.kv_cache import head_pages
from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.plan import LayerStep
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import cdiv

Release = Callable[[list[list[int]]], None]


def commit_layers(
    pool: BlockPool,
    release: Release,
    windows: Sequence[int | None],
    layers: list[LayerKV],
    steps: list[LayerStep],
    block_size: int,
) -> None:
    """Apply each layer's finished step to its state and return the pages it released.

    Args:
        pool: the page pool the trailing pages go back to.
        release: drops a request's reference on whole tables (the old table after a
            compaction; the manager's, which tells the prefix cache first).
        windows: per layer, the sliding window (tokens) whose leading pages are freed, or
            ``None`` for a full-attention layer.
        layers: the request's per-layer state, updated in place.
        steps: the per-layer plans the step ran with.
        block_size: slots per page.
    """
    for window, state, step in zip(windows, layers, steps):
        if step.head_lens is not None or step.to_heads:
            _commit_heads(pool, release, state, step)
            continue
        held = step.num_held + step.num_new
        if step.compress_to is not None and step.compress_to < held:
            state.num_evicted += held - step.compress_to
            held = step.compress_to
        state.num_slots = state.first_slot + held
        if step.compact_table is not None:
            release([state.block_table])
            state.block_table, state.compact_table = step.compact_table, None
        if window is not None:
            _release_outside_window(pool, state, window, block_size)
        keep = cdiv(state.num_held, block_size)
        if len(state.block_table) > keep:
            pool.free(state.block_table[keep:])
            del state.block_table[keep:]


def _commit_heads(pool: BlockPool, release: Release, state: LayerKV, step: LayerStep) -> None:
    """A head-wise layer's step: a compaction into head-wise pages (the runner recorded each
    head's kept slots and pages in ``state``) releases the pages the split left unused; later
    steps append ``num_new`` slots to every head."""
    if step.head_lens is not None:
        state.head_lens = [n + step.num_new for n in step.head_lens]
    else:
        assert state.head_lens is not None, "a head-wise compaction left no split"
        if step.compact_table is not None:
            release([state.block_table])
            state.block_table, state.compact_table = step.compact_table, None
        used = sum(state.head_pages)
        pool.free(state.block_table[used:])
        del state.block_table[used:]
    held = head_pages.mean_held(state.head_lens)
    state.num_evicted += max(0, step.num_held + step.num_new - held)
    state.num_slots = state.first_slot + held


def _release_outside_window(pool: BlockPool, state: LayerKV, window: int, block_size: int) -> None:
    # The next query sits at logical slot num_slots and sees slots > num_slots - window.
    first_needed = max(0, state.num_slots - window + 1)
    num_free = (first_needed - state.first_slot) // block_size
    if num_free > 0:
        pool.free(state.block_table[:num_free])
        del state.block_table[:num_free]
        state.first_slot += num_free * block_size
