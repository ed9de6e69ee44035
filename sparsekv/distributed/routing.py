"""Which replica serves a request: pure policies over a routing key and the replicas' loads.

``prefix`` follows SGLang's cache-aware router in spirit: requests that share the start of their
prompt go to the same replica, where the prefix cache already holds those pages. The key is
the hash of the prompt's first full pages (block-size aligned, as the prefix cache shares whole
pages only); the replica is chosen by rendezvous hashing, so a key keeps its replica for as long
as the replica count stays the same, and changing the count moves only the keys of the replicas
added or removed. When that replica already has more requests in flight than the threshold,
the request goes to the least-loaded replica instead (a hot prefix must not pile up on one
replica while the others idle).
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence


def routing_key(
    prompt_token_ids: Sequence[int],
    block_size: int,
    max_pages: int,
    num_context_tokens: int | None = None,
) -> bytes | None:
    """The routing key of a prompt: a digest of the tokens of its first full pages.

    Args:
        prompt_token_ids: the tokenized prompt.
        block_size: slots per page of the replicas' page pools.
        max_pages: full pages hashed at most.
        num_context_tokens: for ``kv_compression.scope == "context"``, the length of the shared
            context: only its full pages are hashed (the part the replicas cache and share).

    Returns:
        A 16-byte digest, or ``None`` when the prompt (or context) holds no full page: such a
        request shares nothing worth routing for.
    """
    length = len(prompt_token_ids)
    if num_context_tokens is not None:
        length = min(length, num_context_tokens)
    num_pages = min(length // block_size, max_pages)
    if num_pages == 0:
        return None
    tokens = prompt_token_ids[: num_pages * block_size]
    data = b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


def least_loaded(loads: Sequence[int]) -> int:
    """The replica with the fewest requests in flight (the lowest index on ties)."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))


class Router(abc.ABC):
    """Base policy: ``choose(key, loads)`` returns the index of the replica to use."""

    def choose(self, key: bytes | None, loads: Sequence[int]) -> int:
        """Pick a replica.

        Args:
            key: the request's routing key (``None``: no full page to route by).
            loads: requests in flight per replica (its length is the replica count).

        Raises:
            ValueError: ``loads`` is empty.
        """
        if not loads:
            raise ValueError("loads: there must be at least one replica")
        return self._choose(key, loads)

    @abc.abstractmethod
    def _choose(self, key: bytes | None, loads: Sequence[int]) -> int:
        """The policy itself: ``loads`` is non-empty."""


class RoundRobinRouter(Router):
    """Each request goes to the next replica in turn, whatever its prompt or load."""

    def __init__(self) -> None:
        self.num_routed = 0

    def _choose(self, key: bytes | None, loads: Sequence[int]) -> int:
        index = self.num_routed % len(loads)
        self.num_routed += 1
        return index


class LeastLoadedRouter(Router):
    """Each request goes to the replica with the fewest requests in flight."""

    def _choose(self, key: bytes | None, loads: Sequence[int]) -> int:
        return least_loaded(loads)


class PrefixAffinityRouter(Router):
    """Prefix affinity by rendezvous hashing, falling back to least-loaded past a threshold.

    Args:
        queue_threshold: requests in flight on the chosen replica past which (strictly more)
            the request goes to the least-loaded replica.

    Raises:
        ValueError: ``queue_threshold`` < 1.
    """

    def __init__(self, queue_threshold: int) -> None:
        if queue_threshold < 1:
            raise ValueError(f"routing_queue_threshold must be >= 1, got {queue_threshold}")
        self.queue_threshold = queue_threshold

    def preferred(self, key: bytes, num_replicas: int) -> int:
        """The replica a key belongs to: the highest ``hash(key, replica)`` wins."""

        def weight(index: int) -> bytes:
            return hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=8).digest()

        return max(range(num_replicas), key=weight)

    def _choose(self, key: bytes | None, loads: Sequence[int]) -> int:
        if key is None:
            return least_loaded(loads)
        index = self.preferred(key, len(loads))
        if loads[index] > self.queue_threshold:
            return least_loaded(loads)
        return index


# --routing-policy name -> the router, given the queue threshold (used by ``prefix`` only).
ROUTERS = {
    "prefix": PrefixAffinityRouter,
    "round_robin": lambda queue_threshold: RoundRobinRouter(),
    "least_loaded": lambda queue_threshold: LeastLoadedRouter(),
}


def make_router(policy: str, queue_threshold: int) -> Router:
    """The router of a ``--routing-policy`` name.

    Raises:
        ValueError: an unknown policy (naming ``routing_policy``) or a threshold < 1.
    """
    if policy not in ROUTERS:
        raise ValueError(f"routing_policy must be one of {', '.join(ROUTERS)}, got {policy!r}")
    return ROUTERS[policy](queue_threshold)
