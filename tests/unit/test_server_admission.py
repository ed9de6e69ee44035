"""The server's admission rule (503 ``overloaded`` past ``--max-waiting``), without timing.

``async_engine.admits_request`` is checked with explicit numbers; then ``AsyncEngine.add_request``
and the HTTP server (``create_app_for``, httpx's ASGI transport) run around a fake engine whose
loop thread is the test itself: requests sent to the engine wait until the test drains them,
and the snapshot the rule reads is published only when the test says. No sleeps, no threads
racing: what a burst sees is fixed by the test, not by when a real loop publishes its snapshot
(which made the end-to-end burst test flaky, 2bcd345).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from sparsekv.config import SchedulerConfig
from sparsekv.engine.async_engine import AsyncEngine, EngineOverloadedError, admits_request
from sparsekv.engine.model_info import ModelInfo
from sparsekv.engine.stats import EngineStats
from sparsekv.outputs import CompletionOutput, RequestOutput
from sparsekv.sampling_params import SamplingParams
from sparsekv.server.app import create_app_for
from sparsekv.server.serving import ServerContext, ServerSettings

PROMPT = [1, 2, 3]
OUTPUT_IDS = [5, 6]
# A hang (a request that never reaches the engine) fails after this long; a passing run never
# waits on it.
GUARD_S = 60.0


def overloaded_body(max_waiting: int) -> dict:
    return {
        "error": {
            "message": "the server is overloaded: its waiting queue is full (max_waiting "
            f"{max_waiting} beyond the free running slots)",
            "type": "service_unavailable_error",
            "param": None,
            "code": "overloaded",
        }
    }


# ----------------------------------------------------------------- the rule itself
def admits(running: int, waiting: int, pending: int, max_num_seqs: int, max_waiting: int) -> bool:
    return admits_request(
        num_running=running,
        num_waiting=waiting,
        num_pending=pending,
        max_num_seqs=max_num_seqs,
        max_waiting=max_waiting,
    )


def test_idle_one_slot_one_waiting_place_admits_two_requests_and_refuses_the_third():
    # max_num_seqs 1, max_waiting 1, idle: the first takes the free slot, the second waits,
    # the third finds the waiting place taken.
    assert admits(running=0, waiting=0, pending=0, max_num_seqs=1, max_waiting=1)
    assert admits(running=0, waiting=0, pending=1, max_num_seqs=1, max_waiting=1)
    assert not admits(running=0, waiting=0, pending=2, max_num_seqs=1, max_waiting=1)
    # the same three once the engine holds the first two (snapshot, not pending)
    assert admits(running=0, waiting=1, pending=0, max_num_seqs=1, max_waiting=1)
    assert not admits(running=0, waiting=2, pending=0, max_num_seqs=1, max_waiting=1)
    assert not admits(running=1, waiting=1, pending=0, max_num_seqs=1, max_waiting=1)


@pytest.mark.parametrize(
    ("running", "queued", "admitted"),
    [
        # max_num_seqs 4, max_waiting 2: 4 - running free slots take that many queued samples
        (0, 4, True),  # all four take a slot: nothing waits
        (0, 5, True),  # one waits
        (0, 6, False),  # two wait: at the limit
        (1, 4, True),  # 3 free: one waits
        (1, 5, False),  # 3 free: two wait
        (3, 2, True),  # 1 free: one waits
        (3, 3, False),  # 1 free: two wait
        (4, 1, True),  # no free slot: one waits
        (4, 2, False),  # no free slot: two wait
    ],
)
def test_free_running_slots_are_subtracted_and_the_limit_is_exclusive(running, queued, admitted):
    for pending in range(queued + 1):  # a snapshot's sample and a pending one count the same
        waiting = queued - pending
        assert admits(running, waiting, pending, max_num_seqs=4, max_waiting=2) is admitted


def test_running_past_max_num_seqs_frees_no_slot_and_takes_none_back():
    # The rule clamps the free slots at 0: a snapshot counting more running samples than slots
    # (not expected) counts none of them as waiting.
    assert admits(running=6, waiting=1, pending=0, max_num_seqs=4, max_waiting=2)
    assert not admits(running=6, waiting=2, pending=0, max_num_seqs=4, max_waiting=2)


@pytest.mark.parametrize("max_waiting", [1, 2, 7, 256])
def test_the_boundary_is_exactly_max_waiting_samples_beyond_the_free_slots(max_waiting):
    for max_num_seqs, running in [(1, 0), (1, 1), (8, 3), (8, 8)]:
        free = max_num_seqs - running
        last_admitted = free + max_waiting - 1  # samples queued when the last one is admitted
        assert admits(running, last_admitted, 0, max_num_seqs, max_waiting)
        assert not admits(running, last_admitted + 1, 0, max_num_seqs, max_waiting)
        assert admits(running, 0, last_admitted, max_num_seqs, max_waiting)
        assert not admits(running, 0, last_admitted + 1, max_num_seqs, max_waiting)


# ----------------------------------------------------------------- a hand-driven AsyncEngine
class FakeEngine:
    """What ``AsyncEngine`` reads of an ``LLMEngine``: an added request's ``n`` samples wait
    until the test moves them (``scheduler.num_running`` / ``num_waiting``); a prompt that
    starts with 0 is refused as the engine refuses invalid input."""

    def __init__(self, max_num_seqs: int, max_waiting: int) -> None:
        self.config = SimpleNamespace(
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting)
        )
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0)
        self.stats = EngineStats()
        self.added: dict[str, int] = {}  # request id -> n, in the order added

    def kv_usage(self) -> dict:
        return {"pages_used": 0, "pages_total": 0, "compression_ratio": 0.0}

    def add_request(self, request_id, prompt_token_ids, params, compression=None) -> None:
        if prompt_token_ids[0] == 0:
            raise ValueError("prompt: token 0 is refused by this fake engine")
        self.added[request_id] = params.n
        self.scheduler.num_waiting += params.n

    def abort_request(self, request_id):
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.added)


class AliveThread:
    """Stands for the loop thread, which the test plays: alive, never started."""

    def is_alive(self) -> bool:
        return True


class ManualAsyncEngine(AsyncEngine):
    """An ``AsyncEngine`` whose loop thread is the test: what coroutines send waits in the
    command queue (and is announced on ``sent``) until ``drain``; the snapshot that admission
    reads changes only when the loop's own code publishes it (``drain``, ``publish``)."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = AliveThread()
        self.sent: asyncio.Queue = asyncio.Queue()
        self._publish_snapshot()

    def _put(self, command: tuple) -> None:
        super()._put(command)
        self.sent.put_nowait(command)

    def drain(self) -> None:
        """What the loop thread does between steps: handle the commands, publish."""
        self._drain_commands()

    def publish(self, running: int, waiting: int) -> None:
        """Set the engine's counts and publish them, as after a step."""
        self.engine.scheduler.num_running = running
        self.engine.scheduler.num_waiting = waiting
        self._publish_snapshot()

    def finish_all(self) -> None:
        """A step that finishes every added request (``len(OUTPUT_IDS)`` tokens a sample)."""
        outputs = [
            RequestOutput(
                request_id,
                list(PROMPT),
                [
                    CompletionOutput(i, "ab", list(OUTPUT_IDS), finish_reason="length")
                    for i in range(n)
                ],
                finished=True,
            )
            for request_id, n in self.engine.added.items()
        ]
        self.engine.added.clear()
        self.publish(running=0, waiting=0)
        self._deliver(outputs)


def hand_driven(max_num_seqs: int, max_waiting: int) -> ManualAsyncEngine:
    return ManualAsyncEngine(FakeEngine(max_num_seqs, max_waiting))


async def sent_or_done(engine: ManualAsyncEngine, awaitable) -> tuple[asyncio.Task, tuple | None]:
    """Start ``awaitable`` (an add, a POST); returns its task and the command it sent to the
    engine (admitted: it waits there for ``drain``), or ``None`` once it ended without sending
    one (refused). Nothing else runs meanwhile, so the two cannot both happen."""
    task = asyncio.ensure_future(awaitable)
    getter = asyncio.ensure_future(engine.sent.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return task, getter.result()
    getter.cancel()
    return task, None


async def admit(engine: ManualAsyncEngine, awaitable) -> asyncio.Task:
    """The task of an admitted ``awaitable`` (fails at once if it was refused)."""
    task, command = await sent_or_done(engine, awaitable)
    if command is None:
        raise AssertionError(f"refused: {task.exception() or task.result()!r}")
    assert command[0] == "add"
    return task


async def refuse(engine: ManualAsyncEngine, awaitable):
    """What a refused ``awaitable`` raised or returned (fails at once if it was admitted)."""
    task, command = await sent_or_done(engine, awaitable)
    if command is not None:
        task.cancel()
        raise AssertionError(f"admitted: {command[:2]}")
    return task.exception() or task.result()


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), GUARD_S))


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=len(OUTPUT_IDS))


def overloaded(error: BaseException, max_waiting: int) -> bool:
    message = (
        f"the server is overloaded: its waiting queue is full (max_waiting {max_waiting} "
        "beyond the free running slots)"
    )
    return isinstance(error, EngineOverloadedError) and str(error) == message


def test_engine_idle_burst_one_slot_one_waiting_place_admits_two_and_refuses_the_third():
    engine = hand_driven(max_num_seqs=1, max_waiting=1)

    async def scenario():
        engine.start()
        first = await admit(engine, engine.add_request("a", PROMPT, params()))
        second = await admit(engine, engine.add_request("b", PROMPT, params()))
        # neither is in the snapshot yet: both count as pending
        assert overloaded(await refuse(engine, engine.add_request("c", PROMPT, params())), 1)
        assert engine.engine.added == {}  # the loop has not run: nothing reached the engine
        engine.drain()
        streams = [await first, await second]
        assert engine.engine.added == {"a": 1, "b": 1}
        # the engine now holds both (waiting 2, none pending): the queue is still full ...
        assert overloaded(await refuse(engine, engine.add_request("d", PROMPT, params())), 1)
        # ... and after a step, one running and one waiting, still full (free slots: 0)
        engine.publish(running=1, waiting=1)
        assert overloaded(await refuse(engine, engine.add_request("d", PROMPT, params())), 1)
        engine.finish_all()
        for stream in streams:
            assert [output.finished async for output in stream] == [True]

    run(scenario)


def test_engine_a_running_request_leaves_no_free_slot():
    engine = hand_driven(max_num_seqs=1, max_waiting=1)

    async def scenario():
        engine.start()
        engine.publish(running=1, waiting=0)
        waits = await admit(engine, engine.add_request("a", PROMPT, params()))
        assert overloaded(await refuse(engine, engine.add_request("b", PROMPT, params())), 1)
        engine.drain()
        await waits

    run(scenario)


@pytest.mark.parametrize(("first_n", "third_admitted"), [(1, True), (2, False)])
def test_engine_a_pending_request_counts_its_samples(first_n, third_admitted):
    # max_num_seqs 2, max_waiting 1, idle: the two free slots take two samples. A first request
    # of n=2 takes both, so after a second (n=1, waiting) the queue is full; after one of n=1
    # and a second one there is still room.
    engine = hand_driven(max_num_seqs=2, max_waiting=1)

    async def scenario():
        engine.start()
        tasks = [
            await admit(engine, engine.add_request("a", PROMPT, params(first_n))),
            await admit(engine, engine.add_request("b", PROMPT, params(1))),
        ]
        third = engine.add_request("c", PROMPT, params())
        if third_admitted:
            tasks.append(await admit(engine, third))
        else:
            assert overloaded(await refuse(engine, third), 1)
        engine.drain()
        for task in tasks:
            await task
        assert engine.snapshot().num_waiting == first_n + 1 + third_admitted

    run(scenario)


def test_engine_free_slots_are_subtracted_up_to_the_limit():
    # max_num_seqs 4, max_waiting 2; one running, four waiting: 3 free slots, one beyond them.
    engine = hand_driven(max_num_seqs=4, max_waiting=2)

    async def scenario():
        engine.start()
        engine.publish(running=1, waiting=4)
        second = await admit(engine, engine.add_request("a", PROMPT, params()))
        # 5 queued - 3 free = 2 beyond the free slots: at the limit
        assert overloaded(await refuse(engine, engine.add_request("b", PROMPT, params())), 2)
        engine.drain()
        await second
        engine.publish(running=2, waiting=3)  # a step took one more: 2 free, 1 beyond them
        third = await admit(engine, engine.add_request("c", PROMPT, params()))
        engine.drain()
        await third

    run(scenario)


def test_engine_a_request_the_engine_refuses_stops_counting():
    engine = hand_driven(max_num_seqs=1, max_waiting=1)

    async def scenario():
        engine.start()
        bad = await admit(engine, engine.add_request("bad", [0, *PROMPT], params()))
        good = await admit(engine, engine.add_request("a", PROMPT, params()))
        assert overloaded(await refuse(engine, engine.add_request("b", PROMPT, params())), 1)
        engine.drain()
        with pytest.raises(ValueError, match="^prompt: token 0"):
            await bad
        assert engine.sent.get_nowait()[:2] == ("abort", "bad")  # its stream gave up
        await good
        # only "a" is queued now (in the snapshot): the next one takes the waiting place
        third = await admit(engine, engine.add_request("c", PROMPT, params()))
        engine.drain()
        await third
        assert list(engine.engine.added) == ["a", "c"]

    run(scenario)


# ----------------------------------------------------------------- through the HTTP server
def test_engine_a_request_added_and_published_before_its_confirmation_counts_once():
    # The loop thread handled "a" and published (waiting 1) before the event loop ran a's
    # confirmation: "a" is in the snapshot's waiting count and must not count as pending too,
    # else the second request of an idle burst is refused.
    engine = hand_driven(max_num_seqs=1, max_waiting=1)

    async def scenario():
        engine.start()
        a = await admit(engine, engine.add_request("a", PROMPT, params()))
        engine.drain()  # handled and published; a's confirmation is only scheduled
        assert engine.snapshot().num_waiting == 1 and not a.done()
        b = await admit(engine, engine.add_request("b", PROMPT, params()))
        assert overloaded(await refuse(engine, engine.add_request("c", PROMPT, params())), 1)
        engine.drain()
        await a, await b
        engine.finish_all()

    run(scenario)


def test_engine_a_request_confirmed_before_the_snapshot_shows_it_still_counts():
    # The event loop ran a's confirmation before the loop thread published the snapshot that
    # counts "a": it must still count (as pending), else a third request is admitted onto one
    # slot and one waiting place.
    engine = hand_driven(max_num_seqs=1, max_waiting=1)

    async def scenario():
        engine.start()
        a = await admit(engine, engine.add_request("a", PROMPT, params()))
        command = engine._commands.get_nowait()
        engine._handle_add(*command[1:])  # the loop thread's add, its publish not yet run
        await a
        assert engine.snapshot().num_waiting == 0
        b = await admit(engine, engine.add_request("b", PROMPT, params()))
        assert overloaded(await refuse(engine, engine.add_request("c", PROMPT, params())), 1)
        engine.drain()
        await b
        engine.finish_all()

    run(scenario)


def serving(engine: ManualAsyncEngine) -> tuple[ServerContext, httpx.AsyncClient]:
    """The real app around the hand-driven engine, ready (no lifespan: no warm-up)."""
    max_num_seqs = engine.engine.config.scheduler.max_num_seqs
    info = ModelInfo("tiny", None, 4096, max_num_seqs, "prompt", 16, False, False)
    ctx = ServerContext(engine, info, ServerSettings(), lambda: {"": engine.snapshot()})
    ctx.is_ready = True
    transport = httpx.ASGITransport(app=create_app_for(ctx))
    return ctx, httpx.AsyncClient(transport=transport, base_url="http://sparsekv.test")


def completion(n: int = 1, stream: bool = False) -> dict:
    return {"prompt": PROMPT, "max_tokens": len(OUTPUT_IDS), "n": n, "stream": stream}


async def admitted(engine: ManualAsyncEngine, client: httpx.AsyncClient, body: dict):
    """POST ``body``; returns its task once the server sent it to the engine (it waits there)."""
    task, command = await sent_or_done(engine, client.post("/v1/completions", json=body))
    if command is None:
        raise AssertionError(f"refused: {task.exception() or task.result().text}")
    assert command[0] == "add" and command[3].n == body["n"]  # ("add", id, prompt, params, ...)
    return task


async def refused(engine: ManualAsyncEngine, client: httpx.AsyncClient, body: dict):
    """POST ``body``; the answer of a request the server did not send to the engine."""
    return await refuse(engine, client.post("/v1/completions", json=body))


@pytest.mark.parametrize("stream", [False, True])
def test_http_idle_burst_one_slot_one_waiting_place_admits_two_and_answers_the_third_503(stream):
    engine = hand_driven(max_num_seqs=1, max_waiting=1)
    ctx, client = serving(engine)

    async def scenario():
        engine.start()
        async with client:
            first = await admitted(engine, client, completion())
            second = await admitted(engine, client, completion())
            answer = await refused(engine, client, completion(stream=stream))
            assert answer.status_code == 503
            assert answer.headers["content-type"] == "application/json"
            assert answer.json() == overloaded_body(1)
            engine.drain()
            engine.finish_all()
            for task in (first, second):
                answer = await task
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == len(OUTPUT_IDS)
            assert ctx.running_ids == set()

    run(scenario)


def test_http_one_running_and_one_waiting_answers_503_until_a_slot_frees():
    engine = hand_driven(max_num_seqs=1, max_waiting=1)
    _, client = serving(engine)

    async def scenario():
        engine.start()
        async with client:
            engine.publish(running=1, waiting=1)
            answer = await refused(engine, client, completion())
            assert (answer.status_code, answer.json()) == (503, overloaded_body(1))
            engine.publish(running=1, waiting=0)  # the waiting one started (a step ran)
            waits = await admitted(engine, client, completion())
            answer = await refused(engine, client, completion())
            assert (answer.status_code, answer.json()) == (503, overloaded_body(1))
            engine.drain()
            engine.finish_all()
            assert (await waits).status_code == 200

    run(scenario)


def test_http_samples_count_against_the_waiting_queue():
    # max_num_seqs 2, max_waiting 1, idle: n=2 takes both free slots, n=1 waits, then full.
    engine = hand_driven(max_num_seqs=2, max_waiting=1)
    _, client = serving(engine)

    async def scenario():
        engine.start()
        async with client:
            both_slots = await admitted(engine, client, completion(n=2))
            waits = await admitted(engine, client, completion(n=1))
            answer = await refused(engine, client, completion(n=1))
            assert (answer.status_code, answer.json()) == (503, overloaded_body(1))
            engine.drain()
            engine.finish_all()
            answers = [await both_slots, await waits]
            assert [len(a.json()["choices"]) for a in answers] == [2, 1]
            # idle again: the same burst is admitted again
            again = await admitted(engine, client, completion(n=2))
            engine.drain()
            engine.finish_all()
            assert (await again).status_code == 200

    run(scenario)
