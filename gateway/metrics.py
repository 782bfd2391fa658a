"""A small Prometheus text-format registry: Counter, Gauge, Histogram with labels.

The app keeps one `Registry` on `app.state.metrics`; any module may register its own series
(`registry.counter(name, help, labels=(...))` returns the existing series on a repeated call with
the same shape). `GET /metrics` serves `registry.render()` (text format 0.0.4).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.types import Usage

LabelValues = tuple[str, ...]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _format_number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass
class _Series:
    name: str
    help: str
    label_names: tuple[str, ...]
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        names = self.label_names
        if len(labels) == len(names):
            try:  # the hot path: exactly the declared labels, already strings
                key = tuple([labels[n] for n in names])
            except KeyError:
                pass
            else:
                if all(type(v) is str for v in key):
                    return key
                return tuple([str(v) for v in key])
        raise ValueError(f"metric {self.name} takes labels {names}, got {tuple(labels)}")


@dataclass
class Counter(_Series):
    """A monotonically increasing value per label set."""

    kind: str = "counter"
    values: dict[LabelValues, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc {amount})")
        key = self._key(labels)
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        with self.lock:
            items = sorted(self.values.items())
        return [f"{self.name}{_format_labels(self.label_names, k)} {_format_number(v)}"
                for k, v in items]


@dataclass
class Gauge(_Series):
    """A value that goes up and down; or read from a callback at scrape time."""

    kind: str = "gauge"
    values: dict[LabelValues, float] = field(default_factory=dict)
    callback: Callable[[], dict[LabelValues, float]] | None = None

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self.lock:
            self.values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)

    def set_function(self, callback: Callable[[], dict[LabelValues, float]]) -> None:
        """Read the values at scrape time: callback() -> {label values tuple: value}."""
        self.callback = callback

    def lines(self) -> list[str]:
        with self.lock:
            items = dict(self.values)
        if self.callback is not None:
            items.update(self.callback())
        return [f"{self.name}{_format_labels(self.label_names, k)} {_format_number(v)}"
                for k, v in sorted(items.items())]


@dataclass
class Histogram(_Series):
    """Cumulative buckets, sum and count per label set."""

    kind: str = "histogram"
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: dict[LabelValues, list[int]] = field(default_factory=dict)
    sums: dict[LabelValues, float] = field(default_factory=dict)

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self.lock:
            counts = self.counts.get(key)
            if counts is None:
                counts = self.counts[key] = [0] * (len(self.buckets) + 1)
            first = bisect.bisect_left(self.buckets, value) if value == value else len(counts)
            for i in range(first, len(self.buckets)):
                counts[i] += 1  # cumulative: every bucket whose bound is >= value
            counts[-1] += 1
            self.sums[key] = self.sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        counts = self.counts.get(self._key(labels))
        return counts[-1] if counts else 0

    def lines(self) -> list[str]:
        with self.lock:
            items = sorted((k, list(c), self.sums[k]) for k, c in self.counts.items())
        out: list[str] = []
        for key, counts, total in items:
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                le = f'le="{_format_number(bound)}"'
                out.append(f"{self.name}_bucket{_format_labels(self.label_names, key, le)} {n}")
            labels = _format_labels(self.label_names, key)
            out.append(f"{self.name}_sum{labels} {_format_number(total)}")
            out.append(f"{self.name}_count{labels} {counts[-1]}")
        return out


class Registry:
    """Named series, rendered in registration order."""

    def __init__(self) -> None:
        self._series: dict[str, Counter | Gauge | Histogram] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self._get(Counter(name, help, tuple(labels)))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge(name, help, tuple(labels)))  # type: ignore[return-value]

    def histogram(
        self, name: str, help: str, labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        series = Histogram(name, help, tuple(labels), buckets=tuple(sorted(buckets)))
        return self._get(series)  # type: ignore[return-value]

    def _get(self, series: Counter | Gauge | Histogram) -> Counter | Gauge | Histogram:
        with self._lock:
            existing = self._series.get(series.name)
            if existing is None:
                self._series[series.name] = series
                return series
        if type(existing) is not type(series) or existing.label_names != series.label_names:
            raise ValueError(f"metric {series.name} already registered with another shape")
        return existing

    def render(self) -> str:
        """The whole registry in Prometheus text format."""
        with self._lock:
            series = list(self._series.values())
        out: list[str] = []
        for s in series:
            out.append(f"# HELP {s.name} {s.help}")
            out.append(f"# TYPE {s.name} {s.kind}")
            out.extend(s.lines())
        return "\n".join(out) + "\n"


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
