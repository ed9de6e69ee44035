"""``openmp_pool.release_thread_pool``: the calling thread's libgomp workers end, torch keeps
working in it afterwards, the switches that turn it off, and ``AsyncEngine.start`` releasing
the starting thread's pool before its loop thread exists. The speed it buys is measured in
``docs/results/serve_omp_pool_zen4/summary.md``, not asserted here.

Linux only: the pinned CPU wheels of torch link GNU libgomp there (elsewhere the release is a
no-op by design)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest
import torch

from sparsekv.engine import async_engine, openmp_pool
from sparsekv.sampling_params import SamplingParams
from tests.conftest import tiny_checkpoint, tiny_llama_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="libgomp is Linux torch's")


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def test_torch_uses_libgomp():
    assert "OpenMP" in torch.__config__.parallel_info()
    assert openmp_pool.loaded_libgomp() is not None


def test_the_calling_threads_workers_end_and_torch_still_works():
    # Thread ids, not counts: threads other tests left behind may come and go meanwhile. Two
    # threads whatever an earlier test set (new threads take torch's count): one worker.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    x = torch.randn(1024, 4096)
    seen = {}

    def worker():  # a fresh thread: its pool appears with its first parallel region
        before = _threads()
        expected = (x * 2).sum(dim=1)
        pool = _threads() - before
        seen["pool"] = len(pool)
        seen["released"] = openmp_pool.release_thread_pool()
        seen["left"] = len(pool & _threads())
        seen["again"] = openmp_pool.release_thread_pool()  # no pool left: still fine
        torch.testing.assert_close((x * 2).sum(dim=1), expected, rtol=0, atol=0)
        seen["new pool"] = len(_threads() - before - pool)

    thread = threading.Thread(target=worker)
    try:
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(previous)
    # the next parallel region started a new pool of as many workers
    assert seen == {"pool": 1, "released": True, "left": 0, "again": True, "new pool": 1}


def test_switched_off_by_the_environment_a_fork_or_a_missing_library(monkeypatch):
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(openmp_pool.RELEASE_ENV, off)
        assert openmp_pool.release_thread_pool() is False
    monkeypatch.delenv(openmp_pool.RELEASE_ENV)
    monkeypatch.setattr(openmp_pool, "_forked_child", True)
    assert openmp_pool.release_thread_pool() is False
    monkeypatch.setattr(openmp_pool, "_forked_child", False)
    monkeypatch.setattr(openmp_pool, "loaded_libgomp", lambda: None)
    monkeypatch.setattr(openmp_pool, "LIBGOMP", "libgomp-not-loaded.so.9")
    assert openmp_pool.release_thread_pool() is False


def test_a_forked_child_is_marked():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the flag, never release
        os.write(write, b"1" if openmp_pool._forked_child else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert openmp_pool._forked_child is False


def test_async_engine_start_releases_the_starting_threads_pool(
    make_engine, smollm2_tokenizer, monkeypatch
):
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer)
    engine = async_engine.AsyncEngine(make_engine(checkpoint))
    calls = []
    monkeypatch.setattr(
        async_engine,
        "release_thread_pool",
        lambda: calls.append((threading.get_ident(), engine._thread is None)),
    )

    async def scenario():
        engine.start()
        engine.start()  # already running: nothing more
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outputs = [o async for o in engine.generate("r", [1, 2, 3], params)]
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(scenario())
    # once, from the thread that started the engine, before the loop thread existed
    assert calls == [(threading.get_ident(), True)]
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
