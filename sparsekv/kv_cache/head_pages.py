"""Head-wise pages: the layout of a layer whose KV heads keep unequal slot counts.

Adaptive head budgets (``--kv-head-budgets adaptive``, Ada-KV) let the KV heads of a layer
share its budget by score, so after the prefill that compresses it head ``h`` keeps ``n_h``
slots with ``sum(n_h) = num_kv_heads * budget``. Pages stay the pool's pages: a page of
``[2, num_kv_heads, block_size, head_dim]`` is read as ``[2, 1, num_kv_heads * block_size,
head_dim]``, one head's ``slots_per_page = num_kv_heads * block_size`` slots
(``KVStorage.head_view``). Each head owns whole pages: its slots ``0 .. n_h - 1`` fill
``ceil(n_h / slots_per_page)`` of them, and the layer's ``block_table`` lists head 0's pages,
then head 1's, and so on (``LayerKV.head_pages`` counts them). A compressed layer therefore
holds ``sum_h ceil(n_h / slots_per_page)`` pages: the flat layout's ``ceil(budget /
block_size)`` plus at most ``num_kv_heads - 1`` partial pages.

Every later token appends one slot to every head; a head takes a new page when its last one
is full. The compressing step allocates ``num_kv_heads - 1`` pages beyond the flat layout's
(``COMPACT_SLACK``) before the split is known, and releases the ones it did not use at commit.
"""

from __future__ import annotations

from collections.abc import Callable

from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import cdiv


def compact_slack(num_kv_heads: int) -> int:
    """Pages a compaction into head-wise pages may need beyond ``ceil(budget /
    block_size)``: one partial page per head but the first."""
    return num_kv_heads - 1


def head_tables(block_table: list[int], head_pages: list[int]) -> list[list[int]]:
    """Each head's pages: consecutive runs of ``block_table`` of ``head_pages[h]`` entries."""
    tables, start = [], 0
    for count in head_pages:
        tables.append(block_table[start : start + count])
        start += count
    return tables


def split_pages(head_lens: list[int], slots_per_page: int) -> list[int]:
    """Pages each head needs for ``head_lens`` slots."""
    return [cdiv(n, slots_per_page) for n in head_lens]


def growth(state: LayerKV, num_new: int, slots_per_page: int) -> tuple[int, ...]:
    """Pages each head of a head-wise layer adds to hold ``num_new`` more slots."""
    return tuple(
        max(0, cdiv(n + num_new, slots_per_page) - pages)
        for n, pages in zip(state.head_lens, state.head_pages)
    )


def grow(state: LayerKV, pages_per_head: tuple[int, ...], allocate: Callable) -> None:
    """Insert ``pages_per_head[h]`` fresh pages (``allocate(count)``) after head ``h``'s."""
    end = 0
    for head, extra in enumerate(pages_per_head):
        end += state.head_pages[head]
        if extra:
            state.block_table[end:end] = allocate(extra)
            state.head_pages[head] += extra
            end += extra


def mean_held(head_lens: list[int]) -> int:
    """A head-wise layer's ``num_held``: its heads' mean slot count, rounded up."""
    return cdiv(sum(head_lens), len(head_lens))
