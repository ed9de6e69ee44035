"""How the work is spread over processes: one model over tensor-parallel ranks, replicas
behind a router (data parallelism).

Kept apart from the single-engine settings in ``sparsekv.config``: the engine reads only the
tensor-parallel fields (to start its ranks); the rest is read by the code that starts replicas
and routes requests to them.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_POLICIES = ("prefix", "round_robin", "least_loaded")


@dataclass
class ParallelConfig:
    """Tensor-parallel ranks, replicas (Ray Serve) and the ingress that routes requests.

    Attributes:
        tensor_parallel_size: ranks one model is sharded over (``torch.distributed``: gloo on
            CPU, NCCL on CUDA), each holding whole GQA groups and its own page pool
            (``--kv-cache-memory`` is per rank); rank 0 runs the scheduler and the API.
        tensor_parallel_timeout: seconds a rank waits in a collective before the step fails
            (a rank that died or hangs fails the step, never hangs the engine).
        data_parallel_size: replicas of the whole model, each with its own engine and page
            pool (``--kv-cache-memory`` is per replica), on Ray Serve (the ``ray`` extra) when
            above 1.
        threads_per_rank: CPU threads (torch intra-op threads) of each replica, also the CPUs
            it requests from Ray; under tensor parallelism each rank's threads, pinned to its
            own cores (rank ``r`` takes cores ``[r * t, (r + 1) * t)``).
        ray_address: the Ray cluster to join, as ``ray start --head`` prints it.
        routing_policy: how the ingress picks a replica: ``prefix`` (the hash of the prompt's
            first full pages, so requests sharing a prefix meet its cached pages),
            ``least_loaded`` or ``round_robin``.
        routing_queue_threshold: requests in flight on the replica that prefix affinity
            picked past which the request goes to the least-loaded replica instead.
        routing_prefix_pages: full pages at the start of the prompt (or of the shared context)
            whose tokens are hashed to pick the replica.
    """

    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0
    data_parallel_size: int = 1
    threads_per_rank: int | None = None
    ray_address: str | None = None
    routing_policy: str = "prefix"
    routing_queue_threshold: int = 8
    routing_prefix_pages: int = 4

    def validate(self) -> None:
        """Raises: ValueError naming the parameter."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(
                f"tensor_parallel_timeout must be > 0 seconds, got {self.tensor_parallel_timeout}"
            )
        if self.tensor_parallel_size > 1 and self.data_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size: replicas of a tensor-parallel engine are not supported; "
                "use either --tensor-parallel-size or --data-parallel-size"
            )
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
