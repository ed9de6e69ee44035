"""The ingress of ``sparsekv serve --data-parallel-size N``: the OpenAI server over replicas.

The same FastAPI app, handlers, validation, error bodies and streaming as the one-process
server (``create_app_for``), around a ``ReplicaClient`` instead of a local ``AsyncEngine``: the
ingress tokenizes, validates and formats; the replicas (Ray Serve deployments, one engine and
page pool each) generate. /metrics shows each replica's engine metrics with a ``replica`` label,
and the ingress's latency histograms.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from sparsekv.config import EngineConfig
from sparsekv.distributed.cluster import Cluster, connect, deploy_replicas
from sparsekv.distributed.routing import make_router
from sparsekv.engine.model_info import ModelInfo
from sparsekv.server.app import create_app_for
from sparsekv.server.replica_client import ReplicaClient
from sparsekv.server.serving import ServerContext, ServerSettings

logger = logging.getLogger(__name__)


def create_ingress_app(
    handles: list, info: ModelInfo, config: EngineConfig, settings: ServerSettings
) -> FastAPI:
    """The OpenAI app routing to deployed replicas.

    Args:
        handles: one deployment handle per replica (``deploy_replicas``).
        info: the served model's facts (``EngineReplica.model_info``).
        config: the engine configuration (its ``parallel`` section sets the routing).
        settings: HTTP-side settings (test-only fault injection is not available here).

    Raises:
        ValueError: an unknown routing policy or an invalid threshold.
    """
    parallel = config.parallel
    router = make_router(parallel.routing_policy, parallel.routing_queue_threshold)
    client = ReplicaClient(handles, info, router, parallel.routing_prefix_pages)
    ctx = ServerContext(client, info, settings, client.snapshots)
    return create_app_for(ctx)


def start_ingress(config: EngineConfig, settings: ServerSettings) -> tuple[FastAPI, Cluster]:
    """Join or start Ray, deploy the replicas and build the ingress app over them.

    Raises:
        ValueError: Ray is not installed, or an invalid routing setting.
    """
    cluster = connect(config.parallel.ray_address)
    try:
        if settings.fault_marker:
            logger.warning("test-only fault injection is not available with replicas")
        logger.info(
            "deploying %d replicas of %s", config.parallel.data_parallel_size, config.model.model
        )
        handles = deploy_replicas(config)
        info = handles[0].model_info.remote().result()
        return create_ingress_app(handles, info, config, settings), cluster
    except BaseException:
        cluster.shutdown()
        raise
