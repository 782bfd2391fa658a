"""What `/healthz` and the reliability series of `/metrics` report.

The stats writer's state (pending and lost records, a degraded database) is read at scrape time,
so the numbers never drift from the store's own counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.metrics import Registry
from gateway.stats import RecordStore


@dataclass(frozen=True, slots=True)
class HealthReport:
    """The body of `/healthz`: `status` is "ok", or "degraded" while the database is down."""

    status: str
    database: str  # "ok" | "degraded"
    stats_pending: int
    stats_lost: int

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status, "database": self.database,
                "stats_pending": self.stats_pending, "stats_lost": self.stats_lost}


def health_report(store: RecordStore) -> HealthReport:
    """The gateway's health as far as its stats database goes."""
    database = "degraded" if store.degraded else "ok"
    return HealthReport("ok" if database == "ok" else "degraded", database,
                        store.pending(), store.lost)


class StoreMetrics:
    """`prefixgate_stats_records_lost_total`, `_pending`, `_spilled_total` and
    `prefixgate_stats_database_up`, refreshed from the store at each scrape."""

    def __init__(self, registry: Registry, store: RecordStore) -> None:
        self.store = store
        self.lost = registry.counter("prefixgate_stats_records_lost_total",
                                     "Stats records dropped (refused by the database alone).")
        self.spilled = registry.counter("prefixgate_stats_records_spilled_total",
                                        "Stats records written to the local spill file.")
        self.lost.inc(0)  # present from the first scrape, at 0
        self.spilled.inc(0)
        registry.gauge("prefixgate_stats_records_pending",
                       "Stats records not yet in the database (queued or spilled)."
                       ).set_function(lambda: {(): float(store.pending())})
        registry.gauge("prefixgate_stats_database_up",
                       "1 while the stats database accepts writes."
                       ).set_function(lambda: {(): 0.0 if store.degraded else 1.0})

    def refresh(self) -> None:
        """Bring the counters up to the store's own."""
        for counter, value in ((self.lost, self.store.lost), (self.spilled, self.store.spilled)):
            delta = value - counter.get()
            if delta > 0:
                counter.inc(delta)
