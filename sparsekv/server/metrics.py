"""Prometheus metrics (prefix ``sparsekv_``, names listed in docs/server.md) on a per-app registry.

Engine gauges and counters are read from the ``AsyncEngine`` snapshot at scrape time (the engine
owns the counts, so they cannot drift), less what the server's warm-up generation counted
(``ServerMetrics.exclude_counts_so_far``); latency histograms are observed by the server as it
consumes each request's outputs (``RequestTimer``).
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
    (
        "prompt_tokens",
        "Prompt tokens of the requests received, once per request whatever its n (as "
        "usage.prompt_tokens; prefix-cache hits included). vLLM's prompt_tokens_total also "
        "counts hits, but counts an n > 1 prompt once per sample.",
        "num_prompt_tokens",
    ),
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
    (labelled ``replica``) when there are several, else one unlabelled sample.

    Counters are shown less ``baseline`` (per replica label: the stats the engine had counted
    when the server became ready, its warm-up); a replica whose counters went below its
    baseline restarted and counts from zero, so its baseline is dropped.
    """

    def __init__(
        self, snapshots: Callable[[], dict[str, EngineSnapshot]], prefix_caching: bool
    ) -> None:
        self.snapshots = snapshots
        self.prefix_caching = prefix_caching
        self.baseline: dict[str, object] = {}

    def _baseline(self, label: str, stats) -> object | None:
        base = self.baseline.get(label)
        if base is not None and any(_stat(stats, a) < _stat(base, a) for _, _, a in _COUNTERS):
            del self.baseline[label]  # a restarted replica: its counters began anew
            base = None
        return base

    def collect(self):
        snapshots = self.snapshots()
        labels = ["replica"] if any(snapshots) else []
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for label, snapshot in snapshots.items():
                family.add_metric([label] if labels else [], float(getattr(snapshot, attr)))
            yield family
        bases = {label: self._baseline(label, s.stats) for label, s in snapshots.items()}
        for name, doc, attr in _COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for label, snapshot in snapshots.items():
                # A counter a stats object lacks reads 0.
                value = _stat(snapshot.stats, attr)
                if bases[label] is not None:
                    value -= _stat(bases[label], attr)
                family.add_metric([label] if labels else [], value)
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
        self.engine_collector = _EngineCollector(snapshots, prefix_caching)
        self.registry.register(self.engine_collector)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the request's first generated token (of any sample).",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80),
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one sample (a step's gap spread "
            "over the tokens it gave that sample).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the end of the request.",
            buckets=(0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640),
            registry=self.registry,
        )

    def exclude_counts_so_far(self) -> None:
        """Show the engine counters from now on only: what the engines counted so far (the
        server's warm-up generation) is subtracted from every scrape. Call once the
        snapshots are current (after ``refresh`` for replicas)."""
        self.engine_collector.baseline = {
            label: snapshot.stats for label, snapshot in self.engine_collector.snapshots().items()
        }

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        """A timer for one request, started now."""
        return RequestTimer(self)


class RequestTimer:
    """Observes TTFT, ITL and end-to-end latency of one request from its outputs.

    - TTFT (``time_to_first_token_seconds``): once per request, from arrival to the first
      output carrying a token of any sample (the samples of ``n > 1`` share one prefill).
      vLLM runs each of ``n`` samples as a request of its own and observes one TTFT per
      sample.
    - ITL (``inter_token_latency_seconds``): per sample (choice ``index``), each token after
      the sample's first output at the time since that sample's previous token; an output
      that brings one sample ``k`` tokens at once (speculative decoding) observes ``k``
      values of the gap over ``k``. A sample's first token has no gap, so a request of
      ``n`` samples and ``T`` tokens in all observes ``T - n`` values (when each sample's
      first output holds one token). vLLM observes one value per sample and engine output,
      the whole gap, however many tokens it brought.
    - End to end (``e2e_request_latency_seconds``): once, finished, failed or aborted.

    Args:
        metrics: the histograms (``ttft``, ``itl``, ``e2e``) to observe into.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.start = clock()
        self.first_token_seen = False
        self.last_token: dict[int, float] = {}  # per sample index: when its last token came
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        """Record the tokens this output added (call once per output, in order)."""
        now = None
        for completion in output.outputs:
            num_new = completion.num_delta_tokens
            if num_new <= 0:
                continue
            if now is None:
                now = self.clock()
            if not self.first_token_seen:
                self.first_token_seen = True
                self.metrics.ttft.observe(now - self.start)
            last = self.last_token.get(completion.index)
            self.last_token[completion.index] = now
            if last is not None:
                gap = (now - last) / num_new
                for _ in range(num_new):
                    self.metrics.itl.observe(gap)
        if output.finished:
            self.finish()

    def finish(self) -> None:
        """Record the end-to-end latency once (finished, failed or aborted)."""
        if not self.done:
            self.done = True
            self.metrics.e2e.observe(self.clock() - self.start)
