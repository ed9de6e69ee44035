"""One replica: a whole engine behind an ``AsyncEngine``, as a Ray Serve deployment class.

The class is plain Python (``deploy_replicas`` wraps it with ``serve.deployment``), so it runs
and is tested without Ray too. Its ``generate`` is an async generator that Serve streams to the
ingress: first one ``Admission`` (the request was accepted, or why not), then the request's
``RequestOutput``s. Expected failures travel as values, not exceptions, so the ingress maps them
to exactly the API errors of a one-process server; an unexpected exception or a replica that
dies reaches the ingress as a Ray error, which fails that request only.

Leaving the iteration early (the ingress cancels the call when its client disconnects) aborts
the request in the engine, whose pages return to the pool before its next step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from sparsekv.config import EngineConfig
from sparsekv.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineSnapshot,
)
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.engine.model_info import ModelInfo
from sparsekv.errors import ContextLengthError
from sparsekv.outputs import RequestOutput
from sparsekv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Admission kinds, mapped back to the exceptions ``AsyncEngine.add_request`` raises.
ADMISSION_ERRORS = {  # the first entry an exception is an instance of names it
    "context_length": ContextLengthError,
    "invalid": ValueError,
    "overloaded": EngineOverloadedError,
    "dead": EngineDeadError,
}


@dataclass(frozen=True)
class Admission:
    """The first item of a replica's stream: ``error`` is ``None`` when the request runs.

    Attributes:
        error: ``context_length``, ``invalid``, ``overloaded`` or ``dead`` (keys of
            ``ADMISSION_ERRORS``), or ``None`` once the engine accepted the request.
        message: the engine's message (it names the invalid parameter first).
    """

    error: str | None = None
    message: str = ""

    def raise_error(self) -> None:
        """Raise the exception the engine raised on its replica (nothing when admitted)."""
        if self.error is not None:
            raise ADMISSION_ERRORS[self.error](self.message)


def replica_threads(threads_per_rank: int | None, num_replicas: int) -> int:
    """Torch intra-op threads of one replica: the given count, else the cores split evenly."""
    if threads_per_rank is not None:
        return threads_per_rank
    return max(1, (os.cpu_count() or 1) // num_replicas)


class EngineReplica:
    """A loaded, warmed-up engine serving requests for an ingress.

    Args:
        config: the engine configuration (``config.parallel`` sets the thread count).
    """

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        torch.set_num_threads(
            replica_threads(parallel.threads_per_rank, parallel.data_parallel_size)
        )
        engine = LLMEngine(config)
        _warm_up(engine)
        self.info = ModelInfo.of(engine)
        self.engine = AsyncEngine(engine)
        self._started = False
        logger.info("replica ready: %s, %d threads", self.info.model_name, torch.get_num_threads())

    def model_info(self) -> ModelInfo:
        """The served model's facts (the ingress tokenizes and validates with them)."""
        return self.info

    async def snapshot(self) -> EngineSnapshot:
        """The engine's latest published state (pages, queues, counters)."""
        self._start()
        return self.engine.snapshot()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compression: dict | None,
    ) -> AsyncIterator[Admission | RequestOutput]:
        """Run one request: yields its ``Admission``, then its outputs until it finishes.

        Raises:
            EngineDeadError: the engine loop died while the request ran.
        """
        self._start()
        try:
            stream = await self.engine.add_request(
                request_id, prompt_token_ids, params, compression
            )
        except Exception as exc:  # noqa: BLE001 - expected ones are answered as values
            kind = next((k for k, t in ADMISSION_ERRORS.items() if isinstance(exc, t)), None)
            if kind is None:
                raise
            yield Admission(kind, str(exc))
            return
        try:
            yield Admission()
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        """Abort a request (it may have finished already: then nothing happens)."""
        self.engine.abort(request_id)

    def _start(self) -> None:
        # The engine loop must start inside Serve's event loop, not in the constructor.
        if not self._started:
            self.engine.start()
            self._started = True

    def check_health(self) -> None:
        """Serve's health check: raise when the engine loop died, so Serve restarts us."""
        if self._started and not self.engine.is_alive:
            raise RuntimeError(f"the engine loop is not running: {self.engine.error!r}")


def _warm_up(engine: LLMEngine) -> None:
    """One greedy token, so the first request pays no first-call costs (kernels, allocations)."""
    prompt_ids = list(engine.tokenizer("Hello", add_special_tokens=True)["input_ids"]) or [0]
    engine.add_request(
        "warmup", prompt_ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.error is not None:
                raise RuntimeError(f"warm-up generation failed: {output.error}")
