"""Engine-wide counters (read by the server's /metrics)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters (vLLM's names and meanings).

    Attributes:
        num_drafts: (request, step) pairs that carried draft tokens into a step.
        num_draft_tokens: draft tokens proposed and verified.
        num_accepted_tokens: draft tokens accepted.
        num_verify_steps: engine steps with at least one verifying request.
        draft_seconds: time spent proposing drafts (seconds).
        verify_seconds: time of the steps that verified drafts (forward, verification and
            rollback; seconds), less the draft forwards a self-drafting model runs inside them.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request emits per step: 1 + accepted drafts per draft (0 before
        any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def count_step(self, verified: Mapping[str, Any], seconds: float) -> None:
        """Count one step's verified requests (``RunnerOutput.verified``) and its time."""
        self.num_verify_steps += 1
        self.verify_seconds += seconds
        for tokens in verified.values():
            self.num_drafts += 1
            self.num_draft_tokens += tokens.num_drafts
            self.num_accepted_tokens += len(tokens.token_ids) - 1


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
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def count_prefix_lookups(self, hits: list[int]) -> None:
        """Count prefix-cache lookups: one per admitted request, ``hits`` = tokens hit each."""
        self.num_prefix_cache_queries += len(hits)
        self.num_prefix_cache_hits += sum(1 for hit in hits if hit > 0)
        self.num_prefix_cache_hit_tokens += sum(hits)
