"""Engine-wide counters (read by the server's /metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Monotonic counters since engine start."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    num_evicted_tokens: int = 0
    num_failed_steps: int = 0
