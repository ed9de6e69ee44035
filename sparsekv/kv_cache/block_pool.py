"""The page pool: a free list of page ids with reference counts.

The pool knows nothing about layers, requests or attention: it hands out page ids, counts
references (the prefix cache shares pages between requests), and takes them back. Page storage
itself is one tensor owned by the KV manager (layout in docs/design.md, "KV memory").

A page may carry one extra reference held by the prefix cache (``cache_ref``). A page whose
only reference is the cache's is *reclaimable*: it holds cached K/V nobody uses right now, and
``allocate`` takes it back (through the evictor the prefix cache installs) when the free list
runs short. Free + reclaimable pages are what admission may count on.

A pool may hold several *kinds* of pages (layers kept at full precision while
the others store quantized K/V draw from a second pool): kind ``k`` owns the contiguous page
ids ``[start_k, start_k + size_k)``, with its own free list; a layer always allocates from its
kind, and reference counts and caching work on the global ids.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence


class BlockPool:
    """Free lists of page ids (one per kind) with per-page reference counts.

    Args:
        num_pages: pages in the pool, or the page count of each kind (kind 0 first).

    Invariants: a page is in the free list if and only if its reference count is zero; a cached
    page's count includes the cache's reference; ``num_reclaimable_pages`` is the number of
    cached pages whose count is exactly 1.
    """

    def __init__(self, num_pages: int | Sequence[int]) -> None:
        sizes = [num_pages] if isinstance(num_pages, int) else list(num_pages)
        if not sizes or any(size <= 0 for size in sizes):
            raise ValueError(f"kv_cache_memory: a page pool holds no page (num_pages={sizes})")
        self.kind_sizes = sizes
        self.kind_starts = [sum(sizes[:k]) for k in range(len(sizes))]
        self.num_pages = sum(sizes)
        self._free: list[deque[int]] = [
            deque(range(start, start + size)) for start, size in zip(self.kind_starts, sizes)
        ]
        self._ref_counts = [0] * self.num_pages
        self._cached = [False] * self.num_pages
        self._reclaimable = [0] * len(sizes)
        self._evict: Callable[[int, int], int] | None = None

    @property
    def num_kinds(self) -> int:
        return len(self.kind_sizes)

    def kind_of(self, page: int) -> int:
        return bisect_right(self.kind_starts, page) - 1

    @property
    def num_free_pages(self) -> int:
        """Pages on the free lists (reclaimable cached pages not included), all kinds."""
        return sum(len(free) for free in self._free)

    @property
    def num_reclaimable_pages(self) -> int:
        """Cached pages nobody but the cache holds, all kinds."""
        return sum(self._reclaimable)

    def num_available(self, kind: int = 0) -> int:
        """Free plus reclaimable pages of one kind: what an allocation of that kind can get."""
        return len(self._free[kind]) + self._reclaimable[kind]

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def set_evictor(self, evict: Callable[[int, int], int]) -> None:
        """Install ``evict(num_pages, kind) -> pages of that kind freed``, called when a free
        list runs short."""
        self._evict = evict

    def allocate(self, count: int, kind: int = 0) -> list[int]:
        """Take ``count`` free pages of ``kind`` (reference count 1 each), evicting cached
        groups if needed.

        Raises:
            RuntimeError: fewer than ``count`` pages of the kind are free or reclaimable
                (callers check first).
        """
        free = self._free[kind]
        if count > len(free) and self._evict is not None:
            self._evict(count - len(free), kind)
        if count > len(free):
            raise RuntimeError(f"page pool exhausted: asked {count}, free {len(free)}")
        pages = [free.popleft() for _ in range(count)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """Add a reference to pages already in use (sharing)."""
        for page in pages:
            count = self._ref_counts[page]
            assert count > 0, f"incref of free page {page}"
            if count == 1 and self._cached[page]:
                self._reclaimable[self.kind_of(page)] -= 1
            self._ref_counts[page] = count + 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference per page; pages reaching zero return to the free list."""
        for page in pages:
            count = self._ref_counts[page]
            assert count > 0, f"double free of page {page}"
            self._ref_counts[page] = count - 1
            if count == 1:
                assert not self._cached[page], f"cached page {page} lost its cache reference"
                self._free[self.kind_of(page)].append(page)
            elif count == 2 and self._cached[page]:
                self._reclaimable[self.kind_of(page)] += 1

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
                self._reclaimable[self.kind_of(page)] -= 1
            self._cached[page] = False
            self.free([page])

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def any_shared(self, pages: list[int]) -> bool:
        """Whether any of ``pages`` has more than one reference (a C-level scan: the scheduler
        asks this of every compacting layer, twice per step)."""
        return max(map(self._ref_counts.__getitem__, pages), default=0) > 1

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
        free = [page for kind_free in self._free for page in kind_free]
        _check(len(free) == len(set(free)), "the free list holds a page twice")
        for kind, kind_free in enumerate(self._free):
            _check(all(self.kind_of(p) == kind for p in kind_free), "a page in a wrong free list")
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
