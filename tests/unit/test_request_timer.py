"""The server's latency histograms and engine counters on /metrics (``server.metrics``), with a
fake clock: TTFT once per request, ITL per sample at the gap since that sample's previous token
(spread over the tokens one output gave it), end to end once; counters less the warm-up."""

from __future__ import annotations

import pytest

from sparsekv.engine.async_engine import EngineSnapshot
from sparsekv.engine.stats import EngineStats
from sparsekv.outputs import CompletionOutput, RequestOutput
from sparsekv.server.metrics import RequestTimer, ServerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _metrics() -> ServerMetrics:
    return ServerMetrics(lambda: {"": EngineSnapshot()}, prefix_caching=True)


def _observed(metrics: ServerMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    registry = metrics.registry
    full = f"sparsekv_{name}_seconds"
    return registry.get_sample_value(full + "_count"), registry.get_sample_value(full + "_sum")


class Recorder:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(round(value, 9))


class Histograms:
    def __init__(self) -> None:
        self.ttft, self.itl, self.e2e = Recorder(), Recorder(), Recorder()


def _output(deltas: list[int], finished: bool = False) -> RequestOutput:
    """An output whose sample ``i`` gained ``deltas[i]`` tokens."""
    outputs = [CompletionOutput(i, num_delta_tokens=k) for i, k in enumerate(deltas)]
    return RequestOutput("r", [1, 2, 3], outputs, finished)


def _run(steps: list[tuple[float, list[int]]]) -> Histograms:
    """Outputs at the given clock times (the request arrives at 100.0); the last one finishes."""
    histograms, clock = Histograms(), Clock()
    timer = RequestTimer(histograms, clock)
    for i, (at, deltas) in enumerate(steps):
        clock.now = at
        timer.observe(_output(deltas, finished=i == len(steps) - 1))
    return histograms


def test_one_sample():
    h = _run([(100.5, [1]), (100.6, [1]), (100.8, [1]), (101.1, [1])])
    assert h.ttft.values == [0.5]
    assert h.itl.values == [0.1, 0.2, 0.3]
    assert h.e2e.values == [1.1]


def test_three_samples_each_at_its_own_gap():
    # All three start at 100.5; sample 2 is paused (preempted) for one step, then catches up.
    h = _run(
        [
            (100.5, [1, 1, 1]),
            (100.6, [1, 1, 0]),
            (100.8, [1, 1, 1]),
            (101.0, [1, 0, 1]),
        ]
    )
    assert h.ttft.values == [0.5]  # once per request
    # Step by step: samples 0, 1 at 0.1; samples 0, 1, 2 at 0.2, 0.2, 0.3; samples 0, 2 at 0.2.
    assert h.itl.values == [0.1, 0.1, 0.2, 0.2, 0.3, 0.2, 0.2]
    # 10 tokens, 3 samples: 10 - 3 gaps.
    assert len(h.itl.values) == 10 - 3
    assert h.e2e.values == [1.0]


def test_a_sample_that_starts_late_has_no_gap_for_its_first_token():
    h = _run([(100.2, [1, 0]), (100.4, [1, 1]), (100.5, [1, 1])])
    assert h.ttft.values == [0.2]
    assert h.itl.values == [0.2, 0.1, 0.1]


def test_multi_token_deltas_spread_their_samples_gap():
    # Speculative decoding: sample 0 gets 3 tokens in 0.3 s, sample 1 one token in 0.3 s, then
    # sample 1 gets 4 in 0.2 s while sample 0 gets none.
    h = _run([(100.5, [1, 1]), (100.8, [3, 1]), (101.0, [0, 4])])
    assert h.ttft.values == [0.5]
    assert h.itl.values == [0.1, 0.1, 0.1, 0.3, 0.05, 0.05, 0.05, 0.05]


def test_outputs_without_tokens_observe_nothing_until_the_end():
    h = _run([(100.1, [0]), (100.3, [0]), (100.4, [2]), (100.6, [0])])
    assert h.ttft.values == [0.4]
    assert h.itl.values == []  # the first output's two tokens have no previous token
    assert h.e2e.values == [0.6]


def test_finish_is_observed_once_and_into_the_real_histograms():
    metrics, clock = _metrics(), Clock()
    timer = RequestTimer(metrics, clock)
    for at, deltas in [(100.5, [1, 1]), (100.75, [1, 1]), (101.0, [2, 1])]:
        clock.now = at
        timer.observe(_output(deltas))
    timer.finish()
    clock.now = 102.0
    timer.finish()
    assert _observed(metrics, "time_to_first_token") == (1.0, 0.5)
    count, total = _observed(metrics, "inter_token_latency")
    assert count == 5 and total == pytest.approx(0.25 * 2 + 0.125 * 2 + 0.25)
    assert _observed(metrics, "e2e_request_latency") == (1.0, 1.0)


# ----------------------------------------------------------------- counters less the warm-up
def _stats(prompt: int, generated: int, queries: int) -> EngineStats:
    return EngineStats(
        num_prompt_tokens=prompt, num_generation_tokens=generated, num_prefix_cache_queries=queries
    )


def _counters(metrics: ServerMetrics, labels: dict | None = None) -> tuple[float, ...]:
    names = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total")
    metrics.render()  # what a scrape runs
    return tuple(
        metrics.registry.get_sample_value(f"sparsekv_{name}", labels or {}) for name in names
    )


def test_counters_exclude_what_the_engine_counted_before_ready():
    snapshot = {"": EngineSnapshot(stats=_stats(2, 1, 1))}
    metrics = ServerMetrics(lambda: snapshot, prefix_caching=True)
    assert _counters(metrics) == (2, 1, 1)
    metrics.exclude_counts_so_far()
    assert _counters(metrics) == (0, 0, 0)
    snapshot[""] = EngineSnapshot(stats=_stats(2 + 7, 1 + 3, 1 + 1))
    assert _counters(metrics) == (7, 3, 1)


def test_a_restarted_replica_counts_from_zero():
    snapshots = {
        "0": EngineSnapshot(stats=_stats(4, 2, 2)),
        "1": EngineSnapshot(stats=_stats(2, 1, 1)),
    }
    metrics = ServerMetrics(lambda: snapshots, prefix_caching=True)
    metrics.exclude_counts_so_far()
    snapshots["0"] = EngineSnapshot(stats=_stats(10, 5, 3))
    snapshots["1"] = EngineSnapshot(stats=_stats(0, 0, 0))  # restarted
    assert _counters(metrics, {"replica": "0"}) == (6, 3, 1)
    assert _counters(metrics, {"replica": "1"}) == (0, 0, 0)
    snapshots["1"] = EngineSnapshot(stats=_stats(3, 1, 1))
    assert _counters(metrics, {"replica": "1"}) == (3, 1, 1)
