"""Prefix cache: full pages of token ids -> the pages that hold their K/V in every layer.

A request's tokens are cut into full pages of ``block_size`` tokens. Page ``j`` is keyed by a
chained hash: ``blake2b(digest of page j-1 + salt + token ids of page j)``, so a key names the
whole prefix up to and including that page. The value is a *group*: one page id per layer (a
hit skips compute only if every layer has the page), each held by one cache reference in the
``BlockPool``. A hit is the longest run of consecutive groups from page 0.

Groups are evicted whole, least recently used first, and only when the pool needs pages: a
group is evictable while at least one of its pages is held by the cache alone (those pages are
the pool's *reclaimable* ones). Evicting drops the cache reference of every page of the group;
pages still in a request's block table stay with the request. Requests release their groups
tail first, so a prefix's tail is evicted before its head.

*Compressed contexts* (``kv_compression.scope = "context"``) live in the same table and LRU
order as groups keyed by the context's tokens and policy (``CachedContext``): the full pages of
every layer's compressed context, plus a host copy of each layer's partial last page (a
request that attaches the context writes it into a fresh page of its own and appends there).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from sparsekv.kv_cache.block_pool import BlockPool

DIGEST_SIZE = 16


def page_digests(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """Chained digests of every full page of ``token_ids`` (a trailing partial page has none).

    Args:
        token_ids: the sequence, first token first.
        block_size: tokens per page.
        salt: extra key material (e.g. a compression policy) mixed into every page's hash.

    Returns:
        ``len(token_ids) // block_size`` digests of ``DIGEST_SIZE`` bytes.
    """
    digests = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hasher = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
        hasher.update(salt)
        hasher.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = hasher.digest()
        digests.append(parent)
    return digests


@dataclass
class CachedGroup:
    """One cached page of tokens across all layers.

    Attributes:
        digest: chained hash of the prefix ending with this page.
        index: page position in the sequence (tokens ``[index * block_size, ...)``).
        token_ids: the page's ``block_size`` token ids (for inspection and debugging).
        pages: one page id per layer.
    """

    digest: bytes
    index: int
    token_ids: tuple[int, ...]
    pages: list[int]


@dataclass
class ContextLayer:
    """One layer of a cached compressed context.

    Attributes:
        full_pages: the layer's full pages, in slot order (cached, shared read-only).
        num_slots: slots the layer holds after compression.
        num_evicted: tokens compression removed from the layer.
        tail: ``KVStorage.read_pages`` copy of the partial last page, or ``None``.
        residual: int4 pages' full-precision residual (``LayerKV.residual``), or ``None``.
    """

    full_pages: list[int]
    num_slots: int
    num_evicted: int
    tail: tuple[torch.Tensor, ...] | None = None
    residual: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class CachedContext(CachedGroup):
    """A compressed context: ``pages`` are every layer's full pages; ``layers`` say how each
    layer's table is rebuilt; ``num_tokens`` is the context's length in tokens."""

    layers: list[ContextLayer] = field(default_factory=list)
    num_tokens: int = 0


class PrefixCache:
    """Hash table of cached groups with LRU eviction over a ``BlockPool``.

    Args:
        pool: the page pool (the cache installs itself as the pool's evictor).
        block_size: tokens per page.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._groups: OrderedDict[bytes, CachedGroup] = OrderedDict()  # oldest first
        self._page_digest: dict[int, bytes] = {}
        pool.set_evictor(self.evict_pages)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def groups(self) -> list[CachedGroup]:
        """Every cached group, least recently used first."""
        return list(self._groups.values())

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._groups

    def match(self, token_ids: Sequence[int], max_tokens: int, salt: bytes = b"") -> list[int]:
        """Longest cached prefix of ``token_ids`` of at most ``max_tokens`` tokens.

        Touches the matched groups (most recently used).

        Returns:
            The matched groups' digests in page order (``len * block_size`` tokens hit).
        """
        num_pages = max(0, max_tokens) // self.block_size
        limit = token_ids[: num_pages * self.block_size]
        hit = []
        for digest in page_digests(limit, self.block_size, salt):
            if digest not in self._groups:
                break
            hit.append(digest)
        self.touch(hit)
        return hit

    def pages_of(self, digests: list[bytes], layer: int) -> list[int]:
        """One layer's pages of the given groups, in order."""
        return [self._groups[d].pages[layer] for d in digests]

    def insert(self, token_ids: Sequence[int], tables: list[list[int]], salt: bytes = b"") -> int:
        """Cache every full page of ``token_ids`` whose K/V ``tables`` hold.

        Args:
            token_ids: the tokens whose K/V sit at logical slots ``0..len-1`` of every table.
            tables: one block table per layer, covering at least the full pages.
            salt: extra key material, as in ``page_digests``.

        Returns:
            Number of new groups. Pages whose key is cached already are skipped (the table's
            page then stays private to its request).
        """
        added = 0
        for index, digest in enumerate(page_digests(token_ids, self.block_size, salt)):
            if digest in self._groups:
                continue
            pages = [table[index] for table in tables]
            if any(self.pool.is_cached(page) for page in pages):
                continue  # defensive: a page never belongs to two groups
            self.pool.cache_ref(pages)
            start = index * self.block_size
            tokens = tuple(token_ids[start : start + self.block_size])
            self._groups[digest] = CachedGroup(digest, index, tokens, pages)
            for page in pages:
                self._page_digest[page] = digest
            added += 1
        return added

    def insert_context(self, digest: bytes, num_tokens: int, layers: list[ContextLayer]) -> bool:
        """Cache a compressed context under ``digest`` (a key ``page_digests`` never makes).

        Returns:
            False (nothing cached) when the key is cached already or a page is cached by
            another group.
        """
        pages = [page for layer in layers for page in layer.full_pages]
        if digest in self._groups or any(self.pool.is_cached(page) for page in pages):
            return False
        self.pool.cache_ref(pages)
        self._groups[digest] = CachedContext(digest, 0, (), pages, layers, num_tokens)
        for page in pages:
            self._page_digest[page] = digest
        return True

    def lookup_context(self, digest: bytes) -> CachedContext | None:
        """The cached context of ``digest`` (touched), or ``None``."""
        entry = self._groups.get(digest)
        if not isinstance(entry, CachedContext):
            return None
        self.touch([digest])
        return entry

    def touch(self, digests: Iterable[bytes]) -> None:
        """Mark groups most recently used, in the given order (the last is the newest)."""
        for digest in digests:
            if digest in self._groups:
                self._groups.move_to_end(digest)

    def release(self, tables: Iterable[list[int]]) -> None:
        """A request drops these tables: touch their cached groups, tail pages first.

        The head of a prefix ends up most recently used, so eviction takes tails first.
        """
        found: dict[bytes, int] = {}
        for table in tables:
            for page in table:
                digest = self._page_digest.get(page)
                if digest is not None:
                    found[digest] = self._groups[digest].index
        self.touch(sorted(found, key=lambda d: found[d], reverse=True))

    def evict_pages(self, num_pages: int, kind: int = 0) -> int:
        """Evict least recently used groups that hold reclaimable pages (held by the cache
        alone) of page kind ``kind`` until ``num_pages`` such pages are freed or no such group
        is left.

        Returns:
            Pages of the kind freed (groups whose pages are all in block tables are kept:
            evicting them would free nothing).
        """
        freed = 0
        pool = self.pool
        victims = []  # evicted after the walk: from the LRU end, stopping once enough are found
        for digest, group in self._groups.items():
            if freed >= num_pages:
                break
            num = sum(1 for p in group.pages if pool.ref_count(p) == 1 and pool.kind_of(p) == kind)
            if num:
                victims.append(digest)
                freed += num
        for digest in victims:
            self.evict(digest)
        return freed

    def evict_one(self) -> bool:
        """Evict the least recently used group holding a reclaimable page; False if none."""
        return any(self.evict_pages(1, kind) for kind in range(self.pool.num_kinds))

    def evict(self, digest: bytes) -> None:
        """Drop one group and the cache reference of each of its pages."""
        group = self._groups.pop(digest)
        for page in group.pages:
            del self._page_digest[page]
        self.pool.uncache(group.pages)

    def clear(self) -> None:
        """Evict every group."""
        for digest in list(self._groups):
            self.evict(digest)

    def check_invariants(self) -> None:
        """Every group's pages are flagged cached in the pool and mapped back to the group.

        Raises:
            AssertionError: the page map and the groups disagree.
        """
        mapped = 0
        for digest, group in self._groups.items():
            for page in group.pages:
                if not self.pool.is_cached(page) or self._page_digest.get(page) != digest:
                    raise AssertionError(f"cached page {page} is not mapped to its group")
                mapped += 1
        if mapped != len(self._page_digest) or mapped != self.pool.num_cached_pages:
            raise AssertionError("cached pages, the page map and the groups disagree")
