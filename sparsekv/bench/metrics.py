"""Serving metrics as pure functions over per-request event timelines, with vLLM's
benchmark definitions (docs/benchmarks.md, "Serving metrics").

A load generator records, for every request, when it was sent and when each streamed output
token arrived; everything here derives the figures from those timestamps alone, so the math is
tested on synthetic timelines without a server.

Definitions (vLLM's ``benchmark_serving``, DistServe):

* TTFT = first token - send (queueing, tokenization and prefill included);
* TPOT = (E2EL - TTFT) / (output tokens - 1), per request; undefined for one output token;
* ITL = every gap between consecutive token arrivals, pooled over requests;
* E2EL = last token - send;
* throughput = completed requests, output tokens, and prompt + output tokens per second of the
  run; goodput = completed requests per second that meet every SLO given.

Statistics are mean, P50, P90 and P99 (linear interpolation between order statistics, as
``numpy.percentile``). Times are seconds in timelines and milliseconds in summaries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestTimeline:
    """What one request did, as seen by the client.

    Attributes:
        send_s: when the request was sent (seconds on the run's clock).
        token_times_s: arrival of each streamed output token (a chunk with text), in order.
        num_prompt_tokens: prompt tokens (server usage if reported, else the dataset's count).
        num_output_tokens: output tokens (server usage if reported, else chunks received).
        end_s: when the response ended (``[DONE]`` or the error), ``None`` if it never did.
        error: why the request failed, ``None`` on success.
        kv_compression_ratio: sparsekv's usage extra (fraction of KV removed), if reported.
    """

    send_s: float
    token_times_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    end_s: float | None = None
    error: str | None = None
    kv_compression_ratio: float | None = None

    @property
    def is_success(self) -> bool:
        """A request succeeds when it ended without error and streamed at least one token."""
        return self.error is None and bool(self.token_times_s)


def ttft_s(timeline: RequestTimeline) -> float:
    """Time to first token in seconds.

    Raises:
        ValueError: the request streamed no token.
    """
    _require_tokens(timeline)
    return timeline.token_times_s[0] - timeline.send_s


def e2el_s(timeline: RequestTimeline) -> float:
    """End-to-end latency in seconds: send to the last token.

    Raises:
        ValueError: the request streamed no token.
    """
    _require_tokens(timeline)
    return timeline.token_times_s[-1] - timeline.send_s


def tpot_s(timeline: RequestTimeline) -> float | None:
    """Time per output token after the first, in seconds; ``None`` for one output token.

    Uses the token count (server usage), not the chunk count: a chunk can carry several tokens.

    Raises:
        ValueError: the request streamed no token.
    """
    if timeline.num_output_tokens <= 1:
        _require_tokens(timeline)
        return None
    return (e2el_s(timeline) - ttft_s(timeline)) / (timeline.num_output_tokens - 1)


def itls_s(timeline: RequestTimeline) -> list[float]:
    """Every gap between consecutive token arrivals, in seconds (``len(tokens) - 1`` values)."""
    times = timeline.token_times_s
    return [later - earlier for earlier, later in zip(times, times[1:])]


def _require_tokens(timeline: RequestTimeline) -> None:
    if not timeline.token_times_s:
        raise ValueError("the request streamed no token; its latencies are undefined")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation (``numpy.percentile``'s default).

    Returns:
        ``nan`` for no values.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Stats:
    """Mean, P50, P90 and P99 of one latency, in milliseconds (``nan`` when no value)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Stats:
        """Statistics of latencies given in seconds, reported in milliseconds."""
        ms = [1000.0 * v for v in values_s]
        mean = sum(ms) / len(ms) if ms else math.nan
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(mean=mean, p50=p50, p90=p90, p99=p99, count=len(ms))


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:1000", "tpot:100"]`` -> ``{"ttft": 1000.0, "tpot": 100.0}`` (milliseconds).

    Raises:
        ValueError: a malformed item, an unknown metric (not ttft/tpot/e2el) or a value <= 0.
    """
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"goodput: expected METRIC:MS with METRIC in {SLO_METRICS}, got {item!r}"
            )
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"goodput: {value!r} is not a number of milliseconds") from None
        if not limit > 0:
            raise ValueError(f"goodput: the {name} limit must be > 0 ms, got {limit}")
        slos[name] = limit
    return slos


def meets_slos(timeline: RequestTimeline, slos: Mapping[str, float]) -> bool:
    """Whether a successful request meets every SLO (milliseconds); a request with one output
    token has no TPOT and cannot miss that SLO."""
    values = {"ttft": ttft_s(timeline), "tpot": tpot_s(timeline), "e2el": e2el_s(timeline)}
    return all(
        values[name] is None or 1000.0 * values[name] <= limit for name, limit in slos.items()
    )


@dataclass(frozen=True)
class Summary:
    """Serving figures of one run (one concurrency level or one request rate).

    Attributes:
        duration_s: first send to the last request's end, in seconds.
        num_completed / num_failed: requests that streamed to the end / that did not.
        total_input_tokens / total_output_tokens: over completed requests.
        request_throughput: completed requests per second.
        output_throughput: output tokens per second.
        total_token_throughput: prompt + output tokens per second.
        goodput: completed requests per second meeting every SLO (``None`` without SLOs).
        ttft / tpot / itl / e2el: :class:`Stats` in milliseconds.
        peak_concurrency: most requests in flight at once (send to end).
        mean_kv_compression_ratio: mean of the server's reported ratios (``None`` if none).
        errors: up to five distinct failure messages.
    """

    duration_s: float
    num_completed: int
    num_failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    peak_concurrency: int
    mean_kv_compression_ratio: float | None
    slos: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready, latency statistics flattened as ``ttft_ms_mean``, ``ttft_ms_p50``..."""
        data = asdict(self)
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats = data.pop(name)
            data |= {f"{name}_ms_{key}": value for key, value in stats.items() if key != "count"}
        return data


def peak_concurrency(timelines: Sequence[RequestTimeline]) -> int:
    """Most requests in flight at once, counting each from send to end (or its last token)."""
    events = []
    for t in timelines:
        end = t.end_s if t.end_s is not None else (t.token_times_s or [t.send_s])[-1]
        events += [(t.send_s, 1), (end, -1)]
    peak = current = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # ends before sends at a tie
        current += step
        peak = max(peak, current)
    return peak


def summarize(
    timelines: Sequence[RequestTimeline], duration_s: float, slos: Mapping[str, float] | None = None
) -> Summary:
    """Aggregate one run's timelines.

    Args:
        timelines: every request sent, failed ones included.
        duration_s: wall time of the run in seconds (> 0).
        slos: milliseconds per metric (``ttft``, ``tpot``, ``e2el``) for goodput, or None.

    Raises:
        ValueError: ``duration_s <= 0``.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [t for t in timelines if t.is_success]
    failed = [t for t in timelines if not t.is_success]
    tpots = [v for v in (tpot_s(t) for t in done) if v is not None]
    output_tokens = sum(t.num_output_tokens for t in done)
    input_tokens = sum(t.num_prompt_tokens for t in done)
    ratios = [t.kv_compression_ratio for t in done if t.kv_compression_ratio is not None]
    good = sum(meets_slos(t, slos) for t in done) if slos else None
    errors = list(dict.fromkeys(t.error or "no token streamed" for t in failed))[:5]
    return Summary(
        duration_s=duration_s,
        num_completed=len(done),
        num_failed=len(failed),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=None if good is None else good / duration_s,
        ttft=Stats.of_seconds([ttft_s(t) for t in done]),
        tpot=Stats.of_seconds(tpots),
        itl=Stats.of_seconds([gap for t in done for gap in itls_s(t)]),
        e2el=Stats.of_seconds([e2el_s(t) for t in done]),
        peak_concurrency=peak_concurrency(timelines),
        mean_kv_compression_ratio=sum(ratios) / len(ratios) if ratios else None,
        slos=dict(slos or {}),
        errors=errors,
    )


def format_summary(summary: Summary) -> str:
    """A vLLM-style text summary of one run."""
    lines = [
        f"{'completed / failed':<32}{summary.num_completed} / {summary.num_failed}",
        f"{'duration (s)':<32}{summary.duration_s:.2f}",
        f"{'peak concurrency':<32}{summary.peak_concurrency}",
        f"{'request throughput (req/s)':<32}{summary.request_throughput:.3f}",
        f"{'output throughput (tok/s)':<32}{summary.output_throughput:.2f}",
        f"{'total token throughput (tok/s)':<32}{summary.total_token_throughput:.2f}",
    ]
    if summary.goodput is not None:
        lines.append(f"{'goodput (req/s)':<32}{summary.goodput:.3f}  {summary.slos}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = getattr(summary, name)
        lines.append(
            f"{name.upper() + ' (ms)':<32}mean {s.mean:.1f}  p50 {s.p50:.1f}  "
            f"p90 {s.p90:.1f}  p99 {s.p99:.1f}"
        )
    lines += [f"error: {e}" for e in summary.errors]
    return "\n".join(lines)
