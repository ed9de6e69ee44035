"""Ray: join or start a cluster, and deploy the replicas as Ray Serve applications.

Each replica is its own Serve application with one replica of the ``EngineReplica``
deployment, so the ingress can address each one (routing is the ingress's decision, not Serve's
load balancer) and Serve still restarts one that dies or fails its health check. Serve's HTTP
proxy is off: sparsekv's own ingress answers HTTP.

Ray is an optional extra (``pip install -e '.[ray]'`` in the checkout, i.e. ``ray[serve]``);
it is imported here only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sparsekv.config import EngineConfig
from sparsekv.distributed.replica import EngineReplica, replica_threads

logger = logging.getLogger(__name__)

APP_PREFIX = "sparsekv-replica-"
# Requests a replica takes beyond its engine's own limits (aborts and snapshots are calls too).
EXTRA_ONGOING_CALLS = 16


def import_ray():
    """The ``ray`` module, or a ``ValueError`` that says how to install it."""
    try:
        import ray
        from ray import serve  # noqa: F401 - checks the serve extra too
    except ImportError:
        raise ValueError(
            "data_parallel_size > 1 needs Ray Serve: pip install 'ray[serve]>=2.40' "
            "(the ray extra of the sparsekv checkout)"
        ) from None
    return ray


@dataclass
class Cluster:
    """The Ray session this process joined or started.

    Attributes:
        owns_ray: whether this process started Ray (and shuts it down at the end).
    """

    owns_ray: bool

    def shutdown(self) -> None:
        """Delete the replicas' applications, then leave (or stop) Ray."""
        ray = import_ray()
        from ray import serve

        try:
            serve.shutdown()
        finally:
            if self.owns_ray:
                ray.shutdown()


def connect(address: str | None, num_cpus: float | None = None) -> Cluster:
    """Join the Ray cluster at ``address`` (``ray start --head`` prints it), or start one here.

    An already initialised Ray session (a test, a notebook) is used as it is.

    Args:
        address: ``HOST:PORT`` of a running cluster, or ``None`` for a local one.
        num_cpus: CPUs of a local cluster (``None``: all of this machine's).
    """
    ray = import_ray()
    if ray.is_initialized():
        return Cluster(owns_ray=False)
    if address is not None:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return Cluster(owns_ray=True)


def deploy_replicas(config: EngineConfig, num_cpus_per_replica: float | None = None) -> list:
    """Deploy ``config.parallel.data_parallel_size`` replicas and wait until they serve.

    Args:
        config: the engine configuration each replica loads.
        num_cpus_per_replica: Ray CPU resources each replica requests (fractional requests let
            several replicas share a small machine); ``None``: its thread count.

    Returns:
        One deployment handle per replica, in replica order.
    """
    import_ray()
    from ray import serve

    parallel = config.parallel
    num_replicas = parallel.data_parallel_size
    if num_cpus_per_replica is None:
        num_cpus_per_replica = replica_threads(parallel.threads_per_rank, num_replicas)
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(EngineReplica)
    ongoing = config.scheduler.max_num_seqs + config.scheduler.max_waiting + EXTRA_ONGOING_CALLS
    handles = []
    for index in range(num_replicas):
        app = deployment.options(
            name="EngineReplica",
            num_replicas=1,
            max_ongoing_requests=ongoing,
            ray_actor_options={"num_cpus": num_cpus_per_replica},
        ).bind(config)
        logger.info("deploying replica %d of %d", index + 1, num_replicas)
        handles.append(serve.run(app, name=f"{APP_PREFIX}{index}", route_prefix=None))
    return handles
