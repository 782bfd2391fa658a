"""The gateway's Prometheus metrics, on `prometheus_client`.

The app keeps one `Registry` on `app.state.metrics` (its own `CollectorRegistry`, so apps in one
process never share series). Adding a series anywhere is one line,
`registry.counter(name, help, labels=(...))` (or `.gauge`, `.histogram`): a repeated call with
the same shape returns the existing series, another shape is a ValueError. `GET /metrics` serves
`registry.render()` (`prometheus_client.generate_latest`, text format; no `_created` series).

Several worker processes: set `PROMETHEUS_MULTIPROC_DIR` to an empty folder before start-up;
counters, histograms and gauges are then kept in files there and `render()` sums every live
worker's (`prometheus_client.multiprocess`). Callback gauges (`Gauge.set_function`) are read in
the process that serves the scrape.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.types import Usage

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no `x_created`

LabelValues = tuple[str, ...]
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _Series:
    """One named metric with fixed label names; checks the labels of every update.

    The child series of each label-value tuple is looked up once in prometheus_client and kept
    (its `labels()` call costs more than the update itself on the request path); the children
    are the same objects prometheus_client holds, so this adds no series of its own."""

    kind = ""

    def __init__(self, registry: CollectorRegistry, name: str, help: str,
                 label_names: tuple[str, ...]) -> None:
        self.registry = registry
        self.name = name
        self.help = help
        self.label_names = label_names
        self._name_set = frozenset(label_names)
        self._children: dict[tuple[Any, ...], Any] = {}

    def _labels(self, labels: dict[str, str]) -> dict[str, str]:
        if labels.keys() != self._name_set:
            raise ValueError(f"metric {self.name} takes labels {self.label_names}, "
                             f"got {tuple(labels)}")
        return {k: str(v) for k, v in labels.items()}

    def _child(self, metric: Any, labels: dict[str, str]) -> Any:
        if labels.keys() != self._name_set:
            self._labels(labels)  # raises, naming the expected labels
        if not self.label_names:
            return metric
        key = tuple(labels[n] for n in self.label_names)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels(labels))
        return child


class Counter(_Series):
    """A monotonically increasing value per label set (exposed as `<name>_total`)."""

    kind = "counter"

    def __init__(self, registry: CollectorRegistry, name: str, help: str,
                 label_names: tuple[str, ...]) -> None:
        super().__init__(registry, name, help, label_names)
        self.metric = prometheus_client.Counter(name, help, label_names, registry=registry)
        self.sample_name = name if name.endswith("_total") else f"{name}_total"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc {amount})")
        self._child(self.metric, labels).inc(amount)

    def get(self, **labels: str) -> float:
        value = self.registry.get_sample_value(self.sample_name, self._labels(labels))
        return 0.0 if value is None else value


class Gauge(_Series):
    """A value that goes up and down; or read from a callback at scrape time."""

    kind = "gauge"

    def __init__(self, registry: CollectorRegistry, name: str, help: str,
                 label_names: tuple[str, ...]) -> None:
        super().__init__(registry, name, help, label_names)
        self.metric = prometheus_client.Gauge(name, help, label_names, registry=None,
                                              multiprocess_mode="livesum")
        self.callback: Callable[[], dict[LabelValues, float]] | None = None
        registry.register(_GaugeCollector(self))

    def set(self, value: float, **labels: str) -> None:
        self._child(self.metric, labels).set(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(self.metric, labels).inc(amount)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._child(self.metric, labels).dec(amount)

    def set_function(self, callback: Callable[[], dict[LabelValues, float]]) -> None:
        """Read the values at scrape time: callback() -> {label values tuple: value}."""
        self.callback = callback


class _GaugeCollector(Collector):
    """A gauge's set values, updated by its callback's values at scrape time."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.gauge.name, self.gauge.help,
                                  labels=self.gauge.label_names)]

    def collect(self) -> Iterable[Metric]:
        g = self.gauge
        values: dict[LabelValues, float] = {}
        for family in g.metric.collect():
            for sample in family.samples:
                values[tuple(sample.labels[n] for n in g.label_names)] = sample.value
        if g.callback is not None:
            values.update(g.callback())
        family = GaugeMetricFamily(g.name, g.help, labels=g.label_names)
        for key, value in sorted(values.items()):
            family.add_metric(list(key), value)
        return [family]


class Histogram(_Series):
    """Cumulative buckets, sum and count per label set."""

    kind = "histogram"

    def __init__(self, registry: CollectorRegistry, name: str, help: str,
                 label_names: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        super().__init__(registry, name, help, label_names)
        self.buckets = buckets
        self.metric = prometheus_client.Histogram(name, help, label_names, registry=registry,
                                                  buckets=buckets)

    def observe(self, value: float, **labels: str) -> None:
        self._child(self.metric, labels).observe(value)

    def count(self, **labels: str) -> int:
        value = self.registry.get_sample_value(f"{self.name}_count", self._labels(labels))
        return 0 if value is None else int(value)

    def snapshot(self, **labels: str) -> HistogramSnapshot:
        """The cumulative bucket counts (the +Inf bucket last) and the sum of one label set.
        A NaN observation lands in no bucket and makes the sum NaN (prometheus_client)."""
        want = self._labels(labels)
        counts: list[int] = []
        total = 0.0
        for family in self.metric.collect():
            for sample in family.samples:
                if any(sample.labels.get(k) != v for k, v in want.items()):
                    continue
                if sample.name.endswith("_bucket"):
                    counts.append(int(sample.value))
                elif sample.name.endswith("_sum"):
                    total = sample.value
        return HistogramSnapshot(tuple(counts), total)


class HistogramSnapshot(NamedTuple):
    """One label set of a histogram: cumulative counts per bucket (+Inf last) and the sum."""

    counts: tuple[int, ...]
    total: float


class Registry:
    """The app's named series (one `prometheus_client.CollectorRegistry`)."""

    def __init__(self) -> None:
        self.collectors = CollectorRegistry(auto_describe=True)
        self._series: dict[str, Counter | Gauge | Histogram] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        with self._lock:
            found = self._existing(name, Counter, tuple(labels))
            if found is None:
                found = self._series[name] = Counter(self.collectors, name, help, tuple(labels))
        assert isinstance(found, Counter)
        return found

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        with self._lock:
            found = self._existing(name, Gauge, tuple(labels))
            if found is None:
                found = self._series[name] = Gauge(self.collectors, name, help, tuple(labels))
        assert isinstance(found, Gauge)
        return found

    def histogram(
        self, name: str, help: str, labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        with self._lock:
            found = self._existing(name, Histogram, tuple(labels))
            if found is None:
                found = self._series[name] = Histogram(
                    self.collectors, name, help, tuple(labels), tuple(sorted(buckets)))
        assert isinstance(found, Histogram)
        return found

    def _existing(self, name: str, kind: type[_Series],
                  labels: tuple[str, ...]) -> _Series | None:
        existing = self._series.get(name)
        if existing is not None and (type(existing) is not kind
                                     or existing.label_names != labels):
            raise ValueError(f"metric {name} already registered with another shape")
        return existing

    def render(self) -> str:
        """Every series in Prometheus text format (every worker's, in multiprocess mode)."""
        if not os.environ.get(MULTIPROC_ENV):
            return generate_latest(self.collectors).decode()
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        for series in self._series.values():
            if isinstance(series, Gauge) and series.callback is not None:
                merged.register(_CallbackOnly(series))
        return generate_latest(merged).decode()


class _CallbackOnly(Collector):
    """A callback gauge's values alone (multiprocess mode reads the rest from files)."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge

    def collect(self) -> Iterable[Metric]:
        g = self.gauge
        family = GaugeMetricFamily(g.name, g.help, labels=g.label_names)
        for key, value in sorted((g.callback or dict)().items()):
            family.add_metric(list(key), value)
        return [family]


TOKEN_BUCKETS: tuple[float, ...] = (16, 64, 256, 1024, 4096, 16384, 65536)


class GatewayMetrics:
    """The gateway's own series on a Registry (names follow vLLM's where they exist)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.requests = registry.counter(
            "prefixgate_requests_total", "Requests by route, HTTP status and backend.",
            ("route", "status", "backend"))
        self.cache_queries = registry.counter(
            "prefixgate_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (tokens).", ("backend",))
        self.cache_hits = registry.counter(
            "prefixgate_prefix_cache_hits_total",
            "Prompt tokens served from the prefix cache (tokens).", ("backend",))
        self.completion_tokens = registry.counter(
            "prefixgate_completion_tokens_total", "Generated tokens.", ("backend",))
        self.prefill_saved = registry.counter(
            "prefixgate_prefill_saved_seconds_total",
            "Prefill time saved by prefix-cache hits (seconds).", ("backend",))
        self.lint_findings = registry.counter(
            "prefixgate_lint_findings_total", "Requests with a lint finding, by rule.", ("rule",))
        self.latency = registry.histogram(
            "prefixgate_request_duration_seconds", "End-to-end request latency.", ("route",))
        self.ttft = registry.histogram(
            "prefixgate_time_to_first_token_seconds", "Time to first token.", ("backend",))
        self.tpot = registry.histogram(
            "prefixgate_time_per_output_token_seconds", "Time per output token after the first.",
            ("backend",), buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64))
        self.prompt_tokens = registry.histogram(
            "prefixgate_prompt_tokens", "Prompt length in tokens.", ("backend",),
            buckets=TOKEN_BUCKETS)
        self.auth_refused = registry.counter(
            "prefixgate_auth_refused_total",
            "Authentication attempts refused (429) from client addresses locked out after "
            "repeated wrong keys.")
        self.in_flight = registry.gauge(
            "prefixgate_requests_in_flight", "Requests being served now.")
        self.kv_pages_used = registry.gauge(
            "prefixgate_kv_pages_used", "KV-cache pages in use (running requests + cache).")
        self.kv_pages_total = registry.gauge(
            "prefixgate_kv_pages_total", "KV-cache pages in the pool.")
        self.spec_draft_tokens = registry.counter(
            "prefixgate:spec_decode_num_draft_tokens_total",
            "Speculative draft tokens verified (embedded engine).", ("backend",))
        self.spec_accepted_tokens = registry.counter(
            "prefixgate:spec_decode_num_accepted_tokens_total",
            "Speculative draft tokens accepted (embedded engine).", ("backend",))

    def observe_usage(self, usage: Usage, backend: str) -> None:
        """Count one finished request's tokens, prefill saved and timings."""
        self.cache_queries.inc(usage.prompt_tokens, backend=backend)
        self.cache_hits.inc(usage.cached_tokens, backend=backend)
        self.completion_tokens.inc(usage.completion_tokens, backend=backend)
        self.prefill_saved.inc(usage.prefill_saved_ms / 1000.0, backend=backend)
        self.prompt_tokens.observe(usage.prompt_tokens, backend=backend)
        if usage.spec_draft_tokens:
            self.spec_draft_tokens.inc(usage.spec_draft_tokens, backend=backend)
            self.spec_accepted_tokens.inc(usage.spec_accepted_tokens or 0, backend=backend)
        if usage.ttft is not None:
            self.ttft.observe(usage.ttft, backend=backend)
        if usage.tpot is not None and usage.completion_tokens > 1:
            self.tpot.observe(usage.tpot, backend=backend)
