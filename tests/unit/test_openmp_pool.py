"""``openmp_pool.release_thread_pool``: the calling thread's libgomp pool ends, torch keeps
working in it afterwards, and ``AsyncEngine.start`` releases the starting thread's pool before
its loop thread steps the engine. (The speed it buys, the engine thread's full spin-wait, is
measured by ``scripts/compare_serve_ttft.sh``, not asserted here.)"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading

import torch

from sparsekv.engine import async_engine, openmp_pool
from sparsekv.sampling_params import SamplingParams
from tests.conftest import tiny_checkpoint, tiny_llama_config


def test_torch_uses_libgomp_and_the_pool_is_released():
    # The CPU wheels this project pins link GNU libgomp: the release must find it loaded.
    assert "OpenMP" in torch.__config__.parallel_info()
    ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # raises OSError when not loaded
    x = torch.randn(512, 4096)
    expected = (x * 2).sum(dim=1)  # a parallel region: this thread has a pool now
    assert openmp_pool.release_thread_pool()
    assert openmp_pool.release_thread_pool()  # no pool left: still fine
    # The next parallel region in this thread starts a new pool; results are unchanged.
    torch.testing.assert_close((x * 2).sum(dim=1), expected, rtol=0, atol=0)


def test_release_inside_another_thread_leaves_the_main_pool_working():
    x = torch.randn(256, 2048)
    results = []

    def worker():
        results.append(((x @ x.T).trace(), openmp_pool.release_thread_pool()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert results and results[0][1]
    torch.testing.assert_close((x @ x.T).trace(), results[0][0])


def test_without_libgomp_nothing_happens(monkeypatch):
    def missing(*args, **kwargs):
        raise OSError("libgomp.so.1: cannot open shared object file")

    monkeypatch.setattr(openmp_pool.ctypes, "CDLL", missing)
    assert openmp_pool.release_thread_pool() is False


def test_async_engine_start_releases_the_starting_threads_pool(
    make_engine, smollm2_tokenizer, monkeypatch
):
    calls = []
    monkeypatch.setattr(
        async_engine, "release_thread_pool", lambda: calls.append(threading.get_ident())
    )
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer)
    engine = async_engine.AsyncEngine(make_engine(checkpoint))

    async def scenario():
        engine.start()
        engine.start()  # already running: nothing more
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outputs = [o async for o in engine.generate("r", [1, 2, 3], params)]
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(scenario())
    assert calls == [threading.get_ident()]  # once, from the thread that started the engine
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
