"""Serving metric math (vLLM's definitions, docs/benchmarks.md) on synthetic event timelines: exact values."""

from __future__ import annotations

import math

import pytest

from sparsekv.bench import metrics
from sparsekv.bench.metrics import RequestTimeline


def _timelines() -> list[RequestTimeline]:
    return [
        # TTFT 0.5, E2EL 1.1, TPOT (1.1 - 0.5) / 3 = 0.2, ITL 0.1, 0.2, 0.3
        RequestTimeline(
            send_s=0.0,
            token_times_s=[0.5, 0.6, 0.8, 1.1],
            num_prompt_tokens=100,
            num_output_tokens=4,
            end_s=1.15,
            kv_compression_ratio=0.5,
        ),
        # TTFT 0.2, E2EL 0.3, TPOT 0.1, ITL 0.1
        RequestTimeline(
            send_s=1.0,
            token_times_s=[1.2, 1.3],
            num_prompt_tokens=100,
            num_output_tokens=2,
            end_s=1.3,
            kv_compression_ratio=0.25,
        ),
        RequestTimeline(send_s=1.0, end_s=1.05, error="HTTP 500: boom"),
    ]


def test_per_request_latencies():
    first = _timelines()[0]
    assert metrics.ttft_s(first) == pytest.approx(0.5)
    assert metrics.e2el_s(first) == pytest.approx(1.1)
    assert metrics.tpot_s(first) == pytest.approx(0.2)
    assert metrics.itls_s(first) == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_uses_token_count_not_chunk_count_and_is_undefined_for_one_token():
    # Two chunks, but the usage says 5 tokens (a chunk carried several): (0.9 - 0.1) / 4.
    timeline = RequestTimeline(send_s=0.0, token_times_s=[0.1, 0.9], num_output_tokens=5)
    assert metrics.tpot_s(timeline) == pytest.approx(0.2)
    single = RequestTimeline(send_s=0.0, token_times_s=[0.3], num_output_tokens=1)
    assert metrics.tpot_s(single) is None
    assert metrics.itls_s(single) == []
    with pytest.raises(ValueError, match="no token"):
        metrics.ttft_s(RequestTimeline(send_s=0.0))


def test_percentile_interpolates_like_numpy():
    values = [100.0, 100.0, 200.0, 300.0]
    assert metrics.percentile(values, 50) == pytest.approx(150.0)
    assert metrics.percentile(values, 90) == pytest.approx(270.0)
    assert metrics.percentile(values, 99) == pytest.approx(297.0)
    assert metrics.percentile([7.0], 99) == 7.0
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError):
        metrics.percentile(values, 101)


def test_summary_exact_values():
    summary = metrics.summarize(_timelines(), duration_s=2.0)
    assert (summary.num_completed, summary.num_failed) == (2, 1)
    assert summary.errors == ["HTTP 500: boom"]
    assert summary.total_input_tokens == 200 and summary.total_output_tokens == 6
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(3.0)
    assert summary.total_token_throughput == pytest.approx(103.0)
    assert summary.goodput is None
    # TTFT over completed requests: 500 and 200 ms.
    assert summary.ttft.mean == pytest.approx(350.0)
    assert summary.ttft.p50 == pytest.approx(350.0)
    assert summary.ttft.p90 == pytest.approx(470.0)
    assert summary.ttft.p99 == pytest.approx(497.0)
    # TPOT 200 and 100 ms; E2EL 1100 and 300 ms.
    assert summary.tpot.mean == pytest.approx(150.0)
    assert summary.e2el.p50 == pytest.approx(700.0)
    # ITL pools every gap of every request: 100, 200, 300, 100 ms.
    assert summary.itl.count == 4
    assert summary.itl.mean == pytest.approx(175.0)
    assert summary.itl.p50 == pytest.approx(150.0)
    assert summary.itl.p90 == pytest.approx(270.0)
    assert summary.itl.p99 == pytest.approx(297.0)
    assert summary.mean_kv_compression_ratio == pytest.approx(0.375)
    assert summary.peak_concurrency == 3  # the first runs until 1.15 s; two sent at 1.0 s
    flat = summary.to_dict()
    assert flat["ttft_ms_p50"] == pytest.approx(350.0) and "ttft" not in flat


@pytest.mark.parametrize(
    ("slos", "goodput"),
    [
        ({"ttft": 400.0}, 0.5),  # only the second request (TTFT 200 ms)
        ({"ttft": 600.0, "tpot": 150.0}, 0.5),  # the first misses TPOT (200 ms)
        ({"ttft": 600.0, "tpot": 250.0}, 1.0),
        ({"e2el": 1000.0}, 0.5),
        ({"ttft": 100.0}, 0.0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, goodput):
    summary = metrics.summarize(_timelines(), duration_s=2.0, slos=slos)
    assert summary.goodput == pytest.approx(goodput)


def test_single_token_request_cannot_miss_tpot():
    single = RequestTimeline(send_s=0.0, token_times_s=[0.1], num_output_tokens=1)
    assert metrics.meets_slos(single, {"tpot": 1.0, "ttft": 200.0})


def test_parse_slos():
    assert metrics.parse_slos(["ttft:1000", "tpot:100"]) == {"ttft": 1000.0, "tpot": 100.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput"):
            metrics.parse_slos(bad)


def test_no_completed_request_gives_nan_statistics_and_zero_throughput():
    summary = metrics.summarize([RequestTimeline(send_s=0.0, error="refused")], duration_s=1.0)
    assert summary.num_completed == 0 and summary.num_failed == 1
    assert summary.output_throughput == 0.0
    assert math.isnan(summary.ttft.mean) and math.isnan(summary.itl.p99)
    with pytest.raises(ValueError):
        metrics.summarize([], duration_s=0.0)


def test_peak_concurrency_ends_before_sends_at_a_tie():
    back_to_back = [
        RequestTimeline(send_s=0.0, token_times_s=[0.5], end_s=1.0),
        RequestTimeline(send_s=1.0, token_times_s=[1.5], end_s=2.0),
    ]
    assert metrics.peak_concurrency(back_to_back) == 1
