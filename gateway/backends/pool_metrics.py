"""The upstream pools' series on the gateway's metrics registry: calls by outcome, routing
decisions, prompt tokens and the cached tokens predicted beside those reported, per replica;
and gauges read from the replicas themselves (health, requests in flight, shadow pages) of
every pool bound to one registry."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from gateway.metrics import Registry
from gateway.types import Final

if TYPE_CHECKING:
    from gateway.backends.pool import ReplicaPool


class PoolMetrics:
    """The upstream series on the gateway's metrics registry."""

    def __init__(self, registry: Registry, pool: ReplicaPool) -> None:
        lbl = ("replica",)
        self.requests = registry.counter(
            "prefixgate_upstream_requests_total", "Upstream calls by outcome",
            ("replica", "outcome"))
        self.routes = registry.counter(
            "prefixgate_upstream_routes_total", "Routing decisions by reason",
            ("replica", "reason"))
        self.prompt = registry.counter(
            "prefixgate_upstream_prompt_tokens_total", "Prompt tokens sent upstream", lbl)
        self.predicted = registry.counter(
            "prefixgate_upstream_predicted_cached_tokens_total",
            "Cached prompt tokens the shadow cache predicted", lbl)
        self.reported = registry.counter(
            "prefixgate_upstream_reported_cached_tokens_total",
            "Cached prompt tokens the upstream reported", lbl)
        healthy = registry.gauge("prefixgate_upstream_replica_healthy",
                                 "1 when the replica is in routing", lbl)
        inflight = registry.gauge("prefixgate_upstream_inflight",
                                  "Requests in flight per replica", lbl)
        pages = registry.gauge("prefixgate_upstream_shadow_pages",
                               "Pages held by the replica's shadow cache", lbl)
        for gauge, read in ((healthy, lambda r: float(r.healthy)),
                            (inflight, lambda r: float(r.inflight)),
                            (pages, lambda r: float(r.shadow.pages))):
            gauge.set_function(_reader(pool, registry, read))

    def final(self, replica: str, final: Final) -> None:
        """Count one answer; its predicted and reported hits only when it has both (an
        upstream that reports no cached tokens leaves nothing to compare the prediction with,
        and a report of 0 would read as a miss), as /api/stats sums them."""
        u = final.usage
        self.requests.inc(replica=replica, outcome="ok")
        self.prompt.inc(u.prompt_tokens, replica=replica)
        if u.predicted_cached_tokens is not None and u.reported_cached_tokens is not None:
            self.predicted.inc(u.predicted_cached_tokens, replica=replica)
            self.reported.inc(u.reported_cached_tokens, replica=replica)


_POOLS: weakref.WeakKeyDictionary[Registry, list[ReplicaPool]] = weakref.WeakKeyDictionary()


def _reader(pool: ReplicaPool, registry: Registry, read: Any) -> Any:
    """A gauge callback over every pool bound to `registry` (pools of several kinds)."""
    pools = _POOLS.setdefault(registry, [])
    if pool not in pools:
        pools.append(pool)
    return lambda: {(r.name,): read(r) for p in pools for r in p.router.replicas}
