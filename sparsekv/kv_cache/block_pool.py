"""The page pool: a free list of page ids with reference counts.

The pool knows nothing about layers, requests or attention: it hands out page ids, counts
references (the prefix cache shares pages between requests), and takes them back. Page storage
itself is one tensor owned by the KV manager (CONTRACTS.md §2 layout).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Free list of ``num_pages`` page ids with per-page reference counts.

    Args:
        num_pages: pages in the pool.

    Invariant: a page is in the free list if and only if its reference count is zero.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"kv_cache_memory: the pool holds no page (num_pages={num_pages})")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._ref_counts = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free pages (reference count 1 each).

        Raises:
            RuntimeError: fewer than ``count`` pages are free (callers check first).
        """
        if count > len(self._free):
            raise RuntimeError(f"page pool exhausted: asked {count}, free {len(self._free)}")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """Add a reference to pages already in use (sharing)."""
        for page in pages:
            assert self._ref_counts[page] > 0, f"incref of free page {page}"
            self._ref_counts[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference per page; pages reaching zero return to the free list."""
        for page in pages:
            assert self._ref_counts[page] > 0, f"double free of page {page}"
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._free.append(page)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]
