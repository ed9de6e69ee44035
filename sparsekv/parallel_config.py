"""How the work is spread over processes: replicas behind a router (data parallelism).

Kept apart from the single-engine settings in ``sparsekv.config``: an engine never reads these
fields, only the code that starts replicas and routes requests to them.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "round_robin", "least_loaded")


@dataclass
class ParallelConfig:
    """Replicas (Ray Serve) and the ingress that routes requests to them.

    Attributes:
        data_parallel_size: replicas of the whole model, each with its own engine and page
            pool (``--kv-cache-memory`` is per replica), on Ray Serve (the ``ray`` extra) when
            above 1.
        threads_per_rank: CPU threads (torch intra-op threads) of each replica, also the CPUs
            it requests from Ray.
        ray_address: the Ray cluster to join, as ``ray start --head`` prints it.
        routing_policy: how the ingress picks a replica: ``prefix`` (the hash of the prompt's
            first full pages, so requests sharing a prefix meet its cached pages),
            ``least_loaded`` or ``round_robin``.
        routing_queue_threshold: requests in flight on the replica that prefix affinity
            picked past which the request goes to the least-loaded replica instead.
        routing_prefix_pages: full pages at the start of the prompt (or of the shared context)
            whose tokens are hashed to pick the replica.
    """

    data_parallel_size: int = 1
    threads_per_rank: int | None = None
    ray_address: str | None = None
    routing_policy: str = "prefix"
    routing_queue_threshold: int = 8
    routing_prefix_pages: int = 4

    def validate(self) -> None:
        """Raises: ValueError naming the parameter."""
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(
                f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, "
                f"got {self.routing_policy!r}"
            )
        if self.routing_queue_threshold < 1:
            raise ValueError(
                f"routing_queue_threshold must be >= 1, got {self.routing_queue_threshold}"
            )
        if self.routing_prefix_pages < 1:
            raise ValueError(f"routing_prefix_pages must be >= 1, got {self.routing_prefix_pages}")
