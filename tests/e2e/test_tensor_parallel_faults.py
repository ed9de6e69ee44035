"""A tensor-parallel rank that dies or raises fails the request with an error, never a hang.

Offline: ``LLM(tensor_parallel_size=2)`` over a tiny random Llama saved as a Hugging Face
folder (each rank loads it itself); rank 1 is killed (SIGKILL) mid-generation and ``generate``
raises, as does every later call. Server: rank 1 raises at its fourth step (fault injection);
the request in flight answers a 500 ``engine_error``, ``/health`` reports the engine dead, a new
request is refused, and the server stops cleanly.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, ModelConfig
from sparsekv.distributed.tp_launch import FAULT_AFTER_STEPS_ENV
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.llm import LLM
from sparsekv.parallel_config import ParallelConfig
from sparsekv.sampling_params import SamplingParams
from sparsekv.server.app import create_app
from sparsekv.server.serving import ServerSettings
from tests.conftest import tiny_checkpoint, tiny_llama_config
from tests.e2e.conftest import InProcessServer, wait_for

pytestmark = pytest.mark.slow

PROMPT = [504, 3458, 282, 4649, 314, 1345, 30, 378, 2012, 2909, 253, 1345]
TIMEOUT_S = 20.0  # --tensor-parallel-timeout: the bound on any wait for a dead rank


def tiny(tokenizer):
    config = tiny_llama_config(vocab_size=49152)
    return tiny_checkpoint(config, tokenizer, seed=5)


def tensor_parallel_llm(tmp_path, tokenizer) -> LLM:
    """``LLM(tensor_parallel_size=2)`` over the tiny model saved as a Hugging Face folder."""
    _, hf_model = tiny(tokenizer)
    hf_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return LLM(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory=0.02,
        kv_compression={"method": "none"},
        tensor_parallel_size=2,
        tensor_parallel_timeout=TIMEOUT_S,
    )


def test_killed_rank_fails_generate(tmp_path, smollm2_tokenizer):
    llm = tensor_parallel_llm(tmp_path, smollm2_tokenizer)
    try:
        greedy = dict(temperature=0.0, ignore_eos=True)
        first = llm.generate([PROMPT], SamplingParams(max_tokens=4, **greedy))[0]
        assert len(first.outputs[0].token_ids) == 4 and first.outputs[0].finish_reason == "length"
        (pid,) = llm.engine.runner.worker_pids
        start = llm.engine.stats.num_generation_tokens

        def kill_mid_run():
            wait_for(lambda: llm.engine.stats.num_generation_tokens >= start + 3, 120)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_run, daemon=True)
        killer.start()
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel"):
            llm.generate([PROMPT], SamplingParams(max_tokens=2000, **greedy))
        killer.join()
        assert time.monotonic() - began < 120 + TIMEOUT_S
        assert llm.engine.num_unfinished_requests == 0
        with pytest.raises(RuntimeError, match="tensor-parallel"):
            llm.generate([PROMPT], SamplingParams(max_tokens=2, **greedy))
    finally:
        llm.shutdown()
    assert not llm.engine.runner.workers


def test_a_rank_that_dies_while_idle_is_noticed_between_steps(tmp_path, smollm2_tokenizer):
    llm = tensor_parallel_llm(tmp_path, smollm2_tokenizer)
    try:
        engine = llm.engine
        engine.check_health()
        assert engine.fatal_error is None  # all ranks alive: nothing to report
        (pid,) = engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL)

        def noticed() -> bool:
            engine.check_health()  # what the server's idle loop runs every 0.5 s
            return engine.fatal_error is not None

        assert wait_for(noticed, 10)
        assert f"[{pid}] exited" in engine.fatal_error
    finally:
        llm.shutdown()


def test_raising_rank_fails_the_request_and_the_server_stays_up(monkeypatch, smollm2_tokenizer):
    checkpoint, _ = tiny(smollm2_tokenizer)
    monkeypatch.setenv(FAULT_AFTER_STEPS_ENV, "4")  # warm-up = step 1, the request's prefill 2
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(kv_cache_memory=0.02),
        compression=CompressionConfig(method="none"),
        parallel=ParallelConfig(tensor_parallel_size=2, tensor_parallel_timeout=TIMEOUT_S),
    )
    engine = LLMEngine(config, build_engine_parts(config, checkpoint))
    monkeypatch.delenv(FAULT_AFTER_STEPS_ENV)
    server = InProcessServer(create_app(engine, ServerSettings())).start()
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 500, reply.text
        error = reply.json()["error"]
        assert error["code"] == "engine_error"
        assert "tensor-parallel group failed" in error["message"]
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert again.status_code >= 500 and "error" in again.json()
    finally:
        server.stop()
    assert not server.thread.is_alive()
    assert not engine.runner.workers
