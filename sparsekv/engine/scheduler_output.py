"""The whole scheduler -> runner contract: plain data describing one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsekv.engine.request import Request
from sparsekv.kv_cache.manager import LayerStep


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (the runner reads token ids, sampling params, compression).
        num_new_tokens: tokens computed this step, starting at ``request.num_computed_tokens``.
        layers: per-layer KV plan (block tables, held slots, compression target).
        samples: the step reaches the request's last known token, so a token is sampled.
        draft_token_ids: speculative tokens computed after the request's last known token
            (counted in ``num_new_tokens``) and verified by the runner, which lowers
            ``num_new_tokens`` and each layer's ``num_new`` to the positions it keeps.
    """

    request: Request
    num_new_tokens: int
    layers: list[LayerStep]
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step, in batch order.

    Attributes:
        scheduled: requests of this step; their tokens are flattened in this order.
        preempted_ids: requests preempted while scheduling this step.
        prefix_hits: prompt tokens hit in the prefix cache, one entry per request admitted
            with a lookup this step (engine statistics; the runner ignores it).
        draft_seconds: time spent proposing draft tokens for this step (engine statistics).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    prefix_hits: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
