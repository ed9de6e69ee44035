"""Engine-wide counters (read by the server's /metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Monotonic counters since engine start.

    Prefix cache: ``queries`` = lookups (one per request admitted with nothing computed),
    ``hits`` = lookups that hit at least one page, ``hit_tokens`` = prompt tokens served.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_evicted_tokens: int = 0
    num_failed_steps: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_prefix_cache_hit_tokens: int = 0

    def count_prefix_lookups(self, hits: list[int]) -> None:
        """Count prefix-cache lookups: one per admitted request, ``hits`` = tokens hit each."""
        self.num_prefix_cache_queries += len(hits)
        self.num_prefix_cache_hits += sum(1 for hit in hits if hit > 0)
        self.num_prefix_cache_hit_tokens += sum(hits)
