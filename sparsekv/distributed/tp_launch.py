"""Start the tensor-parallel ranks of an engine and run the workers' loop.

``build_tensor_parallel_parts`` is what ``build_engine_parts`` calls for
``--tensor-parallel-size N > 1``: it spawns ranks ``1 .. N-1`` on this machine, joins them in
one process group (gloo on CPU, NCCL on CUDA with device ``cuda:r`` for rank ``r``), shards the
model on every rank and returns rank 0's engine parts (``tp_engine`` describes the protocol).
A worker (``worker_main``) loads the same checkpoint, keeps its shard, waits for rank 0's pool
size, then replays plans until told to stop or rank 0's process is gone.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import queue
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsekv.attention.backends import create_backend
from sparsekv.compression.registry import compressor_class
from sparsekv.config import EngineConfig
from sparsekv.distributed.tp_engine import (
    RankContext,
    TensorParallelRunner,
    pin_threads,
    snapshot_of,
)
from sparsekv.distributed.tp_layout import rank_shard, replica_groups
from sparsekv.distributed.tp_model import shard_model
from sparsekv.distributed.tp_plan import MirrorState
from sparsekv.engine.device_memory import kv_cache_gib
from sparsekv.engine.engine_setup import (
    EngineParts,
    eos_ids_of,
    make_kv_manager,
    model_len_of,
    num_pool_pages,
    resolve_device,
    resolve_dtype,
)
from sparsekv.engine.scheduler import Scheduler
from sparsekv.models.registry import build_model
from sparsekv.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Test-only fault injection: rank 1 raises when it receives this step (1-based).
FAULT_AFTER_STEPS_ENV = "SPARSEKV_TP_FAULT_AT_STEP"
_POLL_S = 1.0


def check_supported(config: EngineConfig) -> None:
    """Raises: ValueError (``tensor_parallel_size``) for settings ranks cannot shard yet."""
    if config.model.weight_dtype != "auto":
        raise ValueError(
            f"tensor_parallel_size: --weight-dtype {config.model.weight_dtype} is not "
            "supported with tensor parallelism (dense weights only)"
        )
    method = config.compression.method
    if method != "none" and compressor_class(method).reconstructs:
        raise ValueError(
            f"tensor_parallel_size: --kv-compression {method} is not supported with tensor "
            "parallelism (the step plan carries no reconstruction rows)"
        )
    if config.speculative.enabled:
        raise ValueError(
            "tensor_parallel_size: speculative decoding is not supported with tensor "
            "parallelism (the step plan carries no draft tokens)"
        )
    if config.cache.kv_cache_dtype == "int4":
        raise ValueError(
            "tensor_parallel_size: --kv-cache-dtype int4 is not supported with tensor "
            "parallelism (its full-precision residuals are not mirrored)"
        )


def build_tensor_parallel_parts(config: EngineConfig, checkpoint=None) -> EngineParts:
    """Start the workers and build rank 0 (``build_engine_parts`` for TP > 1).

    Args:
        config: the engine configuration (``parallel.tensor_parallel_size`` ranks).
        checkpoint: a loaded checkpoint (tests: tiny random models); its config and tensors
            are sent to the workers. ``None``: every rank loads ``config.model.model``.

    Raises:
        ValueError: an unsupported setting or a model that does not shard over the ranks.
        RuntimeError: the group did not form within ``--tensor-parallel-timeout``.
    """
    check_supported(config)
    if dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel_size: this process already runs a tensor-parallel engine "
            "(shut it down first: LLMEngine.shutdown)"
        )
    world = config.parallel.tensor_parallel_size
    device = rank_device(config, 0)
    if checkpoint is None:
        from sparsekv.loader import load_checkpoint

        dtype = resolve_dtype(config.model.dtype, device)
        checkpoint = load_checkpoint(config.model.model, dtype, tokenizer=config.model.tokenizer)
        payload = None
    else:
        payload = (checkpoint.hf_config, checkpoint.state_dict)
    _check_shape(checkpoint.hf_config, world)
    context = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    plans = [context.Queue() for _ in range(world - 1)]
    replies = context.Queue()
    workers = [
        context.Process(
            target=worker_main,
            args=(config, rank, init_method, payload, plans[rank - 1], replies, os.getpid()),
            daemon=True,
            name=f"sparsekv-tp-rank{rank}",
        )
        for rank in range(1, world)
    ]
    for process in workers:
        process.start()
    try:
        pin_threads(0, config.parallel.threads_per_rank, world)
        _init_group(config, 0, init_method, device)
        hf_config = checkpoint.hf_config
        model, backend, dtype, rank_ctx = build_rank(config, 0, hf_config, checkpoint, device)
        specs = model.layer_specs()
        memory_gib = kv_cache_gib(config, device)
        num_pages = num_pool_pages(
            config,
            len(specs),
            model.num_kv_heads,
            model.head_dim,
            dtype,
            memory_gib,
        )
        for plan_queue in plans:
            plan_queue.put(num_pages)
        kv = make_kv_manager(config, model, backend, device, dtype, num_pages)
    except BaseException:
        for process in workers:
            process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    runner = TensorParallelRunner(
        model,
        kv,
        torch.device(device),
        backend,
        rank_ctx,
        workers,
        plans,
        replies,
        config.parallel.tensor_parallel_timeout,
    )
    logger.info("tensor parallel: %d ranks, rank 0 holds %s", world, rank_ctx.shard)
    scheduler = Scheduler(config.scheduler, kv)
    scheduler.drafts_allowed = False  # a per-request "speculative" decodes plainly here
    return EngineParts(
        model_name=config.model.served_model_name or checkpoint.name,
        tokenizer=checkpoint.tokenizer,
        hf_config=hf_config,
        model=model,
        kv=kv,
        scheduler=scheduler,
        runner=runner,
        max_model_len=model_len_of(config, hf_config),
        eos_token_ids=eos_ids_of(
            hf_config, checkpoint.tokenizer, getattr(checkpoint, "eos_token_ids", ())
        ),
        vocab_size=hf_config.vocab_size,
        dtype=dtype,
    )


def build_rank(config: EngineConfig, rank: int, hf_config, checkpoint, device: str):
    """``(sharded model, backend, dtype, RankContext)`` of ``rank`` (after the group formed:
    the replica groups are created here, by every rank in the same order)."""
    dtype = resolve_dtype(config.model.dtype, device)
    backend = create_backend(config.model.attention_backend, device, config.model.prefill_qk_dtype)
    state_dict = checkpoint.state_dict if hasattr(checkpoint, "state_dict") else checkpoint[1]
    model = build_model(hf_config, state_dict, dtype, device, model_len_of(config, hf_config))
    variant = model.variant
    shard = rank_shard(
        rank,
        config.parallel.tensor_parallel_size,
        variant.num_heads,
        variant.num_kv_heads,
        variant.intermediate_size,
        variant.vocab_size,
    )
    mine = None
    for ranks in replica_groups(variant.num_kv_heads, shard.world_size):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return shard_model(model, shard), backend, dtype, RankContext(shard, mine)


def rank_device(config: EngineConfig, rank: int) -> str:
    """``cpu``, or ``cuda:<rank>`` on CUDA (one device per rank)."""
    device = resolve_device(config.model.device)
    return f"cuda:{rank}" if device.startswith("cuda") else device


def worker_main(config, rank, init_method, payload, plans, replies, parent_pid) -> None:
    """Rank ``rank``'s process: build the shard, then replay rank 0's plans.

    Any exception is logged and ends the process (exit code 1): the other ranks' collectives
    then fail instead of waiting for this one.
    """
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    try:
        world = config.parallel.tensor_parallel_size
        pin_threads(rank, config.parallel.threads_per_rank, world)
        device = rank_device(config, rank)
        _init_group(config, rank, init_method, device)
        if payload is None:
            from sparsekv.loader import load_checkpoint

            dtype = resolve_dtype(config.model.dtype, device)
            checkpoint = load_checkpoint(
                config.model.model, dtype, tokenizer=config.model.tokenizer
            )
            payload = (checkpoint.hf_config, checkpoint.state_dict)
        model, backend, dtype, rank_ctx = build_rank(config, rank, payload[0], payload, device)
        num_pages = _next(plans, parent_pid)
        kv = make_kv_manager(config, model, backend, device, dtype, num_pages)
        runner = ModelRunner(model, kv, torch.device(device), backend)
        mirror = MirrorState(kv, rank_ctx.compressor)
        fault_at = int(os.environ.get(FAULT_AFTER_STEPS_ENV, "0")) if rank == 1 else 0
        steps = 0
        while True:
            message = _next(plans, parent_pid)
            plan = None if message is None else pickle.loads(message)
            if plan is None or plan.kind == "stop":
                break
            out = mirror.apply(plan)
            if plan.kind == "snapshot":
                replies.put((rank_ctx.shard, snapshot_of(kv, plan.snapshot_id)))
                continue
            steps += 1
            if steps == fault_at:
                raise RuntimeError(f"injected fault at step {steps} ({FAULT_AFTER_STEPS_ENV})")
            runner.execute(out)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed; exiting", rank)
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _next(plans, parent_pid: int):
    """The next message from rank 0, or ``None`` once rank 0's process is gone."""
    while True:
        try:
            return plans.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None


def _init_group(config: EngineConfig, rank: int, init_method: str, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=config.parallel.tensor_parallel_size,
        timeout=datetime.timedelta(seconds=config.parallel.tensor_parallel_timeout),
    )


def _check_shape(hf_config, world: int) -> None:
    """The model's heads split over ``world`` ranks (before any process starts)."""
    from sparsekv.models.decoder import text_config
    from sparsekv.models.families import variant_of

    variant = variant_of(text_config(hf_config))
    for rank in range(world):
        rank_shard(
            rank,
            world,
            variant.num_heads,
            variant.num_kv_heads,
            variant.intermediate_size,
            variant.vocab_size,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
