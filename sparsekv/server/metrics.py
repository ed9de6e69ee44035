"""Prometheus metrics (prefix ``sparsekv_``, names listed in docs/server.md) on a per-app registry.

Engine gauges and counters are read from the ``AsyncEngine`` snapshot at scrape time (the engine
owns the counts, so they cannot drift); latency histograms are observed by the server as it
consumes each request's outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sparsekv.engine.async_engine import EngineSnapshot
from sparsekv.outputs import RequestOutput

PREFIX = "sparsekv_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, help, snapshot attribute)
_GAUGES = (
    ("num_requests_running", "Requests (samples) running in the engine.", "num_running"),
    ("num_requests_waiting", "Requests (samples) waiting or preempted.", "num_waiting"),
    ("kv_pages_used", "KV pool pages in use.", "num_pages_used"),
    ("kv_pages_total", "KV pool pages in all.", "num_pages_total"),
    (
        "kv_compression_ratio",
        "Fraction of the running requests' full KV caches removed by compression (sliding "
        "windows excluded).",
        "compression_ratio",
    ),
)
# (name without _total, help, EngineStats attribute)
_COUNTERS = (
    (
        "kv_tokens_evicted",
        "KV slots removed by compression, summed over layers.",
        "num_evicted_tokens",
    ),
    ("prompt_tokens", "Prompt tokens received.", "num_prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("preemptions", "Requests preempted (swapped or recomputed).", "num_preemptions"),
    ("aborted_requests", "Requests aborted (client disconnect, timeout, shutdown).", "num_aborted"),
    (
        "prefix_cache_queries",
        "Prefix cache lookups (one per request admitted with nothing computed).",
        "num_prefix_cache_queries",
    ),
    (
        "prefix_cache_hits",
        "Prefix cache lookups that hit at least one page.",
        "num_prefix_cache_hits",
    ),
    (
        "prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache.",
        "num_prefix_cache_hit_tokens",
    ),
    (
        "spec_decode_num_drafts",
        "Speculative decoding: (request, step) pairs that carried draft tokens.",
        "spec_decode.num_drafts",
    ),
    (
        "spec_decode_draft_tokens",
        "Speculative decoding: draft tokens proposed and verified.",
        "spec_decode.num_draft_tokens",
    ),
    (
        "spec_decode_accepted_tokens",
        "Speculative decoding: draft tokens accepted.",
        "spec_decode.num_accepted_tokens",
    ),
    (
        "spec_decode_verify_steps",
        "Speculative decoding: engine steps that verified draft tokens.",
        "spec_decode.num_verify_steps",
    ),
    (
        "spec_decode_draft_seconds",
        "Speculative decoding: seconds spent proposing draft tokens.",
        "spec_decode.draft_seconds",
    ),
    (
        "spec_decode_verify_seconds",
        "Speculative decoding: seconds of the steps that verified draft tokens, less the "
        "draft forwards run inside them.",
        "spec_decode.verify_seconds",
    ),
)
# (name, help, EngineStats attribute path): gauges derived from the counters
_STAT_GAUGES = (
    (
        "spec_decode_acceptance_rate",
        "Speculative decoding: accepted over proposed draft tokens since start.",
        "spec_decode.acceptance_rate",
    ),
    (
        "spec_decode_mean_accepted_length",
        "Speculative decoding: tokens emitted per verifying request and step since start "
        "(1 + accepted drafts per draft).",
        "spec_decode.mean_accepted_length",
    ),
)


def _stat(stats, path: str) -> float:
    """``stats``' attribute at the dotted ``path`` (0 where a stats object lacks it)."""
    value = stats
    for name in path.split("."):
        value = getattr(value, name, 0)
    return float(value)


class _EngineCollector:
    """Yields the engine gauges and counters from the latest snapshots, one sample per replica
    (labelled ``replica``) when there are several, else one unlabelled sample."""

    def __init__(
        self, snapshots: Callable[[], dict[str, EngineSnapshot]], prefix_caching: bool
    ) -> None:
        self.snapshots = snapshots
        self.prefix_caching = prefix_caching

    def collect(self):
        snapshots = self.snapshots()
        labels = ["replica"] if any(snapshots) else []
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for label, snapshot in snapshots.items():
                family.add_metric([label] if labels else [], float(getattr(snapshot, attr)))
            yield family
        for name, doc, attr in _COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for label, snapshot in snapshots.items():
                # A counter a stats object lacks reads 0.
                family.add_metric([label] if labels else [], _stat(snapshot.stats, attr))
            yield family
        for name, doc, attr in _STAT_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for label, snapshot in snapshots.items():
                family.add_metric([label] if labels else [], _stat(snapshot.stats, attr))
            yield family
        yield GaugeMetricFamily(
            PREFIX + "prefix_caching_enabled",
            "1 when prefix caching is on (off for models with sliding-window layers).",
            value=float(self.prefix_caching),
        )


class ServerMetrics:
    """The app's registry: engine collector plus latency histograms (seconds).

    Args:
        snapshots: the engine state per replica label (``""``: one unlabelled engine).
        prefix_caching: whether the engines' prefix cache is on.
    """

    def __init__(
        self, snapshots: Callable[[], dict[str, EngineSnapshot]], prefix_caching: bool
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(snapshots, prefix_caching))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80),
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the end of the request.",
            buckets=(0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640),
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        """A timer for one request, started now."""
        return RequestTimer(self)


class RequestTimer:
    """Observes TTFT, ITL and end-to-end latency of one request from its outputs."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last_token: float | None = None
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        """Record the tokens this output added (call once per output, in order)."""
        num_new = sum(c.num_delta_tokens for c in output.outputs)
        if num_new > 0:
            now = time.monotonic()
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.start)
                num_new -= 1
            if num_new > 0 and self.last_token is not None:
                gap = (now - self.last_token) / num_new
                for _ in range(num_new):
                    self.metrics.itl.observe(gap)
            self.last_token = now
        if output.finished:
            self.finish()

    def finish(self) -> None:
        """Record the end-to-end latency once (finished, failed or aborted)."""
        if not self.done:
            self.done = True
            self.metrics.e2e.observe(time.monotonic() - self.start)
