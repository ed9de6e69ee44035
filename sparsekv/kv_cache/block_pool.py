"""The page pool: a free list of page ids with reference counts.

The pool knows nothing about layers, requests or attention: it hands out page ids, counts
references (the prefix cache shares pages between requests), and takes them back. Page storage
itself is one tensor owned by the KV manager (CONTRACTS.md §2 layout).

A page may carry one extra reference held by the prefix cache (``cache_ref``). A page whose
only reference is the cache's is *reclaimable*: it holds cached K/V nobody uses right now, and
``allocate`` takes it back (through the evictor the prefix cache installs) when the free list
runs short. Free + reclaimable pages are what admission may count on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class BlockPool:
    """Free list of ``num_pages`` page ids with per-page reference counts.

    Args:
        num_pages: pages in the pool.

    Invariants: a page is in the free list if and only if its reference count is zero; a cached
    page's count includes the cache's reference; ``num_reclaimable_pages`` is the number of
    cached pages whose count is exactly 1.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"kv_cache_memory: the pool holds no page (num_pages={num_pages})")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._ref_counts = [0] * num_pages
        self._cached = [False] * num_pages
        self.num_reclaimable_pages = 0
        self._evict: Callable[[int], int] | None = None

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list (reclaimable cached pages not included)."""
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def set_evictor(self, evict: Callable[[int], int]) -> None:
        """Install ``evict(num_pages) -> pages freed``, called when the free list runs short."""
        self._evict = evict

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free pages (reference count 1 each), evicting cached groups if needed.

        Raises:
            RuntimeError: fewer than ``count`` pages are free or reclaimable (callers check
                first).
        """
        if count > len(self._free) and self._evict is not None:
            self._evict(count - len(self._free))
        if count > len(self._free):
            raise RuntimeError(f"page pool exhausted: asked {count}, free {len(self._free)}")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """Add a reference to pages already in use (sharing)."""
        for page in pages:
            count = self._ref_counts[page]
            assert count > 0, f"incref of free page {page}"
            if count == 1 and self._cached[page]:
                self.num_reclaimable_pages -= 1
            self._ref_counts[page] = count + 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference per page; pages reaching zero return to the free list."""
        for page in pages:
            count = self._ref_counts[page]
            assert count > 0, f"double free of page {page}"
            self._ref_counts[page] = count - 1
            if count == 1:
                assert not self._cached[page], f"cached page {page} lost its cache reference"
                self._free.append(page)
            elif count == 2 and self._cached[page]:
                self.num_reclaimable_pages += 1

    def cache_ref(self, pages: list[int]) -> None:
        """Add the prefix cache's reference to pages in use (at most one per page)."""
        for page in pages:
            assert not self._cached[page], f"page {page} is cached twice"
            self.incref([page])
            self._cached[page] = True

    def uncache(self, pages: list[int]) -> None:
        """Drop the prefix cache's reference; a page nobody else holds returns to the pool."""
        for page in pages:
            assert self._cached[page], f"page {page} is not cached"
            if self._ref_counts[page] == 1:
                self.num_reclaimable_pages -= 1
            self._cached[page] = False
            self.free([page])

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    @property
    def num_cached_pages(self) -> int:
        """Pages holding a cache reference (reclaimable or not)."""
        return sum(self._cached)

    def check_invariants(self, holders: dict[int, int]) -> None:
        """Check counts against ``holders`` (page -> block tables holding it).

        Raises:
            AssertionError: a count differs from holders + cache, a held page is free, the
                free list repeats a page, or the reclaimable count is off.
        """
        free = list(self._free)
        _check(len(free) == len(set(free)), "the free list holds a page twice")
        free_set = set(free)
        reclaimable = 0
        for page in range(self.num_pages):
            expected = holders.get(page, 0) + int(self._cached[page])
            count = self._ref_counts[page]
            _check(count == expected, f"page {page}: ref count {count}, expected {expected}")
            _check((count == 0) == (page in free_set), f"page {page}: free list disagrees")
            reclaimable += int(self._cached[page] and count == 1)
        _check(reclaimable == self.num_reclaimable_pages, "reclaimable page count is off")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
