"""Tensor parallelism in the engine: rank 0 schedules, every rank runs its shard of each step.

``build_tensor_parallel_parts`` (what ``build_engine_parts`` calls for
``--tensor-parallel-size N > 1``) starts ranks ``1 .. N-1`` as processes on this machine
(``torch.multiprocessing`` spawn), joins them in a ``torch.distributed`` group (gloo on CPU,
NCCL on CUDA, one device per rank) and returns the engine parts of rank 0, whose runner is a
``TensorParallelRunner``. Rank 0 keeps the API, the scheduler and the KV manager; it sends each
step's plan (``tp_plan.StepBroadcast``) to every worker through a queue of its own (a worker
may wait for the next step for as long as the engine is idle), then all ranks run the step's
forward together, meeting in its collectives. Every rank's page pool has the page count rank 0
sized for its own KV heads (rank 0 holds the most), so the page ids of rank 0's plan are valid
everywhere.

Failures: a worker that raises logs the error and exits; a rank that dies or hangs makes the
other ranks' collectives fail (connection closed, or ``--tensor-parallel-timeout``), so the
step fails with an error on rank 0 and the engine's requests fail from then on
(``TensorParallelRunner.fatal_error``); nothing waits forever. ``shutdown`` stops the workers.
"""

from __future__ import annotations

import logging
import os
import pickle

import torch
import torch.distributed as dist

from sparsekv.compression.registry import get_compressor
from sparsekv.distributed.tp_compression import ShardedCompressor
from sparsekv.distributed.tp_layout import RankShard
from sparsekv.distributed.tp_plan import PageOpLog, StepBroadcast, build_step
from sparsekv.engine.scheduler_output import SchedulerOutput
from sparsekv.runner.model_runner import ModelRunner, RunnerOutput

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed; the engine cannot run steps any more."""


class RankContext:
    """What every rank holds: its shard, its replica group and how to wrap compressors."""

    def __init__(self, shard: RankShard, replica_group) -> None:
        self.shard = shard
        self.replica_group = replica_group

    def compressor(self, policy):
        """The request's compressor as this rank runs it (``None`` for a full cache)."""
        return self.wrap(get_compressor(policy) if policy is not None else None)

    def wrap(self, inner):
        """``inner`` as this rank runs it: itself where the rank's KV heads score alone."""
        if inner is None or isinstance(inner, ShardedCompressor):
            return inner
        if not inner.evicts_randomly and not self.shard.replicated:
            return inner
        return ShardedCompressor(inner, self.shard, self.replica_group)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step's plan to the workers, then runs its own shard.

    Args:
        model, kv, device, backend: as ``ModelRunner`` (the model sharded, the KV manager
            holding rank 0's heads).
        rank: this rank's ``RankContext``.
        workers: the worker processes, ranks 1 .. N-1.
        plans: one queue per worker, the plans go there.
        replies: the queue workers answer snapshots on.
        timeout_s: the group's collective timeout (``--tensor-parallel-timeout``).
    """

    def __init__(
        self, model, kv, device, backend, rank: RankContext, workers, plans, replies, timeout_s
    ):
        super().__init__(model, kv, device, backend)
        self.timeout_s = timeout_s
        self.rank = rank
        self.workers = workers
        self.plans = plans
        self.replies = replies
        self.page_ops = PageOpLog(kv)
        self.fatal_error: str | None = None
        self._known: dict = {}  # request id -> rank 0's RequestKV, for requests mirrored

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self.workers]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step on every rank.

        Raises:
            TensorParallelError: the group failed in this step or before (the step's
                requests fail; so does every later step).
        """
        if self.fatal_error is not None:
            raise TensorParallelError(self.fatal_error)
        if out.is_empty:
            return RunnerOutput()
        for item in out.scheduled:
            item.request.compressor = self.rank.wrap(item.request.compressor)
        plan = build_step(out, self.kv, self._known, self.page_ops.take())
        try:
            self._send(plan)
            return super().execute(out)
        except Exception as exc:
            self._fail(exc)
            raise TensorParallelError(self.fatal_error) from exc

    def snapshot_keys(self, request_id: str) -> list[tuple[RankShard, list[torch.Tensor]]]:
        """Every rank's cached keys of a request: per rank its shard and, per layer,
        ``[rank's KV heads, held slots, head_dim]`` (a diagnostic for tests)."""
        plan = StepBroadcast(kind="snapshot", snapshot_id=request_id)
        plan.page_ops = self.page_ops.take()
        plan.items = build_step_items(self.kv, request_id)
        self._send(plan)
        reports = [(self.rank.shard, snapshot_of(self.kv, request_id))]
        for _ in self.workers:
            reports.append(self.replies.get(timeout=self.timeout_s))
        return sorted(reports, key=lambda report: report[0].rank)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self.workers:
            message = pickle.dumps(StepBroadcast(kind="stop"))
            for plans in self.plans:
                plans.put(message)
            for process in self.workers:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
            self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def check_workers(self) -> None:
        """Fail the group now if a worker exited (between steps: an idle engine's health
        check, so that ``/health`` reports a dead rank before a request finds it)."""
        if self.fatal_error is None and any(not p.is_alive() for p in self.workers):
            dead = [p.pid for p in self.workers if not p.is_alive()]
            self._fail(TensorParallelError(f"tensor-parallel worker(s) {dead} exited"))

    def _send(self, plan: StepBroadcast) -> None:
        dead = [p.pid for p in self.workers if not p.is_alive()]
        if dead:
            raise TensorParallelError(f"tensor-parallel worker(s) {dead} exited")
        # Pickled now: the queue's feeder thread would pickle later, after this step's
        # commit changed the lists the plan shares with the KV manager.
        message = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for plans in self.plans:
            plans.put(message)

    def _fail(self, exc: Exception) -> None:
        self.fatal_error = f"tensor-parallel group failed: {type(exc).__name__}: {exc}"
        logger.error("%s; the engine's requests fail from now on", self.fatal_error)
        for process in self.workers:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()


def build_step_items(kv, request_id: str):
    """The counters of one request for a snapshot (no tokens, no layer steps)."""
    from sparsekv.distributed.tp_plan import ScheduledItem, layer_counters

    counters = [layer_counters(state) for state in kv.get(request_id).layers]
    return [ScheduledItem(request_id, 0, [], [], counters, False)]


def snapshot_of(kv, request_id: str) -> list[torch.Tensor]:
    """Per layer, the held keys ``[KV heads, held, head_dim]`` of a request on this rank."""
    layers = []
    for layer, state in enumerate(kv.get(request_id).layers):
        keys, _ = kv.storage(layer).gather(state, state.block_table, state.num_held)
        layers.append(keys.float().cpu())
    return layers


def pin_threads(rank: int, threads: int | None, world_size: int) -> None:
    """``threads`` torch threads pinned to cores ``[rank * threads, (rank + 1) * threads)``
    of the allowed ones (``None``: the cores divided by the ranks, unpinned)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if threads is None:
        if rank:  # rank 0 keeps its process's setting
            torch.set_num_threads(max(1, (len(cores) or os.cpu_count() or 1) // world_size))
        return
    torch.set_num_threads(threads)
    mine = cores[rank * threads : (rank + 1) * threads]
    if len(mine) == threads:
        os.sched_setaffinity(0, mine)
    else:
        logger.warning("rank %d: %d cores cannot hold rank %d's threads", rank, len(cores), rank)
