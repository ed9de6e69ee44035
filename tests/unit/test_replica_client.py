"""The ingress's replica client without Ray: fake deployment handles that stream what a replica
would (admission, outputs, a failure), so routing, load accounting, aborts and the mapping of
replica failures to the one-process engine's exceptions are checked in milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from sparsekv.distributed.replica import Admission, EngineReplica
from sparsekv.distributed.routing import PrefixAffinityRouter, RoundRobinRouter
from sparsekv.engine.async_engine import (
    EngineDeadError,
    EngineOverloadedError,
    EngineSnapshot,
    RequestTimeoutError,
)
from sparsekv.engine.model_info import ModelInfo
from sparsekv.errors import ContextLengthError
from sparsekv.outputs import CompletionOutput, RequestOutput
from sparsekv.sampling_params import SamplingParams
from sparsekv.server.replica_client import ReplicaClient
from tests.conftest import tiny_checkpoint, tiny_llama_config

INFO = ModelInfo("tiny", None, 4096, 8, "prompt", 16, True, True)
PARAMS = SamplingParams(max_tokens=2)


def _output(request_id: str, text: str, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, text, finish_reason="length" if finished else None)
    return RequestOutput(request_id, [1, 2], [completion], finished=finished)


class _Call:
    """A streaming deployment response: ``items`` in order (an exception is raised)."""

    def __init__(self, items: list, delay: float = 0.0) -> None:
        self.items = list(items)
        self.delay = delay
        self.cancelled = False

    async def __anext__(self):
        await asyncio.sleep(self.delay)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


class _Method:
    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    def remote(self, *args):
        self.handle.calls.append((self.name, args))
        if self.name == "generate":
            call = _Call(self.handle.script(args[0]), self.handle.delay)
            self.handle.streams.append(call)
            call.cancel = lambda: setattr(call, "cancelled", True)
            return call
        if self.name == "snapshot":
            return self.handle.answer_snapshot()
        return None


class _Handle:
    """A fake deployment handle; ``script(request_id)`` gives the items a replica streams."""

    def __init__(self, script, delay: float = 0.0) -> None:
        self.script = script
        self.delay = delay
        self.calls: list = []
        self.streams: list[_Call] = []
        self.snapshot_value: EngineSnapshot | Exception = EngineSnapshot(num_running=3)

    def options(self, **_):
        return self

    def __getattr__(self, name):
        return _Method(self, name)

    async def answer_snapshot(self):
        if isinstance(self.snapshot_value, Exception):
            raise self.snapshot_value
        return self.snapshot_value


def _ok(request_id):
    return [Admission(), _output(request_id, "a", False), _output(request_id, "ab", True)]


def _client(*handles, router=None) -> ReplicaClient:
    client = ReplicaClient(handles, INFO, router or RoundRobinRouter(), prefix_pages=4)
    client.start()
    return client


async def _collect(client, request_id, prompt=(1, 2, 3), timeout=None):
    stream = await client.add_request(request_id, list(prompt), PARAMS, None, timeout)
    return [o.outputs[0].text async for o in stream]


def test_outputs_stream_back_and_loads_return_to_zero():
    a, b = _Handle(_ok), _Handle(_ok)
    client = _client(a, b)

    async def scenario():
        stream = await client.add_request("r1", [1, 2, 3], PARAMS)
        assert client.loads == [1, 0] and list(client.streams) == ["r1"]
        texts = [o.outputs[0].text async for o in stream]
        assert texts == ["a", "ab"]
        assert await _collect(client, "r2") == ["a", "ab"]

    asyncio.run(scenario())
    assert client.loads == [0, 0] and client.num_routed == [1, 1] and not client.streams
    assert a.calls[0] == ("generate", ("r1", [1, 2, 3], PARAMS, None))
    assert [c[0] for c in b.calls] == ["generate"]


@pytest.mark.parametrize(
    "kind, exc",
    [("invalid", ValueError), ("overloaded", EngineOverloadedError), ("dead", EngineDeadError)],
)
def test_admission_errors_are_the_engines_exceptions(kind, exc):
    handle = _Handle(lambda rid: [Admission(kind, "max_tokens must be >= 1")])
    client = _client(handle)
    with pytest.raises(exc, match="^max_tokens must be >= 1$"):
        asyncio.run(_collect(client, "r1"))
    assert client.loads == [0] and not client.streams


def test_replica_failure_mid_request_is_engine_dead_and_aborts():
    def script(rid):
        return [Admission(), _output(rid, "a", False), RuntimeError("actor died\nmore")]

    handle = _Handle(script)
    client = _client(handle)
    with pytest.raises(EngineDeadError, match="^replica 0 failed: RuntimeError: actor died$"):
        asyncio.run(_collect(client, "r1"))
    assert client.loads == [0]
    assert handle.streams[0].cancelled and ("abort", ("r1",)) in handle.calls


def test_timeout_and_explicit_abort_reach_the_replica():
    handle = _Handle(_ok, delay=0.2)
    client = _client(handle)
    with pytest.raises(RequestTimeoutError, match="timeout of 0.05 s"):
        asyncio.run(_collect(client, "slow", timeout=0.05))
    assert ("abort", ("slow",)) in handle.calls and client.loads == [0]

    async def abort_midway():
        stream = await client.add_request("r2", [1], PARAMS)
        client.abort("r2")
        client.abort("unknown")  # ignored
        return [o async for o in stream]

    assert asyncio.run(abort_midway()) == []
    assert ("abort", ("r2",)) in handle.calls and client.loads == [0]


def test_routing_key_follows_the_scope():
    client = _client(_Handle(_ok), _Handle(_ok), router=PrefixAffinityRouter(4))
    shared = list(range(64))
    home = client.route(shared + [1], None)
    assert client.route(shared + [2, 3], None) == home
    # scope context: only the context's pages count, whatever follows.
    context = {"scope": "context", "context_tokens": 32}
    assert client.route(shared[:32] + [7] * 40, context) == client.route(shared[:32], None)


def test_snapshots_per_replica_and_shutdown():
    a, b = _Handle(_ok), _Handle(_ok)
    b.snapshot_value = RuntimeError("gone")
    client = _client(a, b)
    asyncio.run(client.refresh())
    assert client.snapshots() == {"0": EngineSnapshot(num_running=3), "1": EngineSnapshot()}
    asyncio.run(client.shutdown())
    assert not client.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(client, "late"))


def test_replica_streams_admission_then_outputs_without_ray(make_engine, smollm2_tokenizer):
    """``EngineReplica.generate`` on a real engine: the admission, then the outputs, and an
    invalid request answered as a value."""
    replica = EngineReplica.__new__(EngineReplica)  # skip loading a model: use a test engine
    from sparsekv.engine.async_engine import AsyncEngine

    checkpoint, _ = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer)
    replica.engine = AsyncEngine(make_engine(checkpoint))
    replica._started = False

    async def scenario():
        items = [i async for i in replica.generate("r", [1, 2, 3], PARAMS, None)]
        bad = [i async for i in replica.generate("b", [1], SamplingParams(max_tokens=-1), None)]
        too_long = SamplingParams(max_tokens=10**6)  # past the context with any prompt
        over = [i async for i in replica.generate("c", [1], too_long, None)]
        await replica.engine.shutdown()
        return items, bad, over

    items, bad, over = asyncio.run(scenario())
    assert (
        items[0] == Admission() and items[-1].finished and len(items[-1].outputs[0].token_ids) == 2
    )
    assert bad == [Admission("invalid", bad[0].message)] and bad[0].message.startswith("max_tokens")
    # The ingress raises what the engine raised: the server answers context_length_exceeded.
    assert over == [Admission("context_length", over[0].message)]
    with pytest.raises(ContextLengthError, match="^max_tokens"):
        over[0].raise_error()
    with pytest.raises(ValueError) as info:
        bad[0].raise_error()
    assert type(info.value) is ValueError
