"""Upstream replica pools: the `Backend` the gateway uses when `--upstream` is given.

`ReplicaPool` tokenizes each request once (tiktoken, for the shadow caches), asks the `Router`
for a replica, streams the answer from it, and completes the `Final` with the shadow cache's
prediction beside the upstream's own report. A replica fault before any text was sent fails
over to another replica; after that it reaches the client as an error (an SSE error event when
streaming). `build_upstream_backend(config, metrics)` builds one pool per upstream kind from
`GatewayConfig.upstreams` (repeated URLs of one kind are replicas of one pool).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import anyio
import httpx

from gateway.backends.anthropic_upstream import AnthropicUpstream
from gateway.backends.openai_upstream import OpenAIUpstream
from gateway.backends.router import Replica, Route, Router, RouterConfig
from gateway.backends.upstream_http import UpstreamOptions, is_replica_fault
from gateway.metrics import Registry
from gateway.shadow import PromptTokenizer, ShadowCache, ShadowConfig
from gateway.types import Backend, BackendError, ChatRequest, Final, TextDelta

UpstreamBackend = OpenAIUpstream | AnthropicUpstream


def shadow_config_for(kind: str, url: str) -> ShadowConfig:
    """The caching rule a provider is known for (self-hosted servers: 16-token pages)."""
    host = httpx.URL(url).host
    if host.endswith("openai.com"):
        return ShadowConfig(page_size=128, min_cached_tokens=1024)
    if host.endswith("deepseek.com"):
        return ShadowConfig(page_size=64, min_cached_tokens=64)
    if kind == "anthropic":
        return ShadowConfig(page_size=16, min_cached_tokens=1024)
    return ShadowConfig(page_size=16)


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
        u = final.usage
        self.requests.inc(replica=replica, outcome="ok")
        self.prompt.inc(u.prompt_tokens, replica=replica)
        self.predicted.inc(u.predicted_cached_tokens or 0, replica=replica)
        self.reported.inc(u.reported_cached_tokens or 0, replica=replica)


_POOLS: weakref.WeakKeyDictionary[Registry, list[ReplicaPool]] = weakref.WeakKeyDictionary()


def _reader(pool: ReplicaPool, registry: Registry, read: Any) -> Any:
    """A gauge callback over every pool bound to `registry` (pools of several kinds)."""
    pools = _POOLS.setdefault(registry, [])
    if pool not in pools:
        pools.append(pool)
    return lambda: {(r.name,): read(r) for p in pools for r in p.router.replicas}


class ReplicaPool:
    """Replicas of one upstream kind behind one `Backend`."""

    def __init__(
        self, kind: str, backends: Sequence[UpstreamBackend], *,
        router: RouterConfig | None = None, shadow: Sequence[ShadowConfig] | None = None,
        metrics: Registry | None = None, tokenizer: PromptTokenizer | None = None,
    ) -> None:
        if not backends:
            raise ValueError("a replica pool needs at least one upstream")
        shadows = list(shadow) if shadow is not None else [
            shadow_config_for(kind, b.options.url) for b in backends]
        if len(shadows) != len(backends):
            raise ValueError("need one shadow config per replica")
        self.name = kind
        names = _unique([b.replica for b in backends])
        self.router = Router([Replica(n, b, ShadowCache(s))
                              for n, b, s in zip(names, backends, shadows, strict=True)], router)
        self.tokenizer = tokenizer or PromptTokenizer()
        self.metrics: PoolMetrics | None = None
        if metrics is not None:
            self.bind_metrics(metrics)

    def bind_metrics(self, registry: Registry) -> None:
        """Register this pool's series on `registry` (the app's, for a pool built outside it)."""
        self.metrics = PoolMetrics(registry, self)

    def models(self) -> list[str]:
        """The replicas' configured model ids, or ["*"] (any model is passed upstream)."""
        seen = {m: None for r in self.router.replicas for m in r.backend.models()}  # type: ignore[attr-defined]
        return list(seen) or ["*"]

    def kv_pages(self) -> tuple[int, int] | None:
        return None

    async def aclose(self) -> None:
        for r in self.router.replicas:
            await r.backend.aclose()  # type: ignore[attr-defined]

    async def stream(self, req: ChatRequest) -> AsyncGenerator[TextDelta | Final, None]:
        tokens = await anyio.to_thread.run_sync(self.tokenizer.encode, req)  # off the loop
        tried: set[str] = set()
        while True:
            route = self.router.choose(tokens, req.namespace, tried)
            if route is None:
                raise BackendError(503, "no upstream replica is available",
                                   kind="upstream_unavailable")
            tried.add(route.replica.name)
            emitted = False
            try:
                async with aclosing(self._attempt(req, tokens, route)) as attempt:
                    async for item in attempt:
                        emitted = True
                        yield item
                return
            except BackendError as err:
                if emitted or not is_replica_fault(err) or len(tried) >= len(self.router.replicas):
                    raise

    async def _attempt(
        self, req: ChatRequest, tokens: list[int], route: Route
    ) -> AsyncGenerator[TextDelta | Final, None]:
        replica = route.replica
        predicted = route.matched if route.matched >= replica.shadow.config.min_cached_tokens else 0
        if self.metrics:
            self.metrics.routes.inc(replica=replica.name, reason=route.reason)
        replica.inflight += 1
        recorded = False
        try:
            async with aclosing(replica.backend.stream(req)) as upstream:  # type: ignore[attr-defined]
                async for item in upstream:
                    if not recorded:  # the upstream has prefilled the prompt by now
                        replica.shadow.record(tokens, req.namespace)
                        recorded = True
                    if isinstance(item, Final):
                        replica.mark_ok()
                        replica.served += 1
                        item = self._complete(item, replica, tokens, predicted)
                    elif item.usage is not None:
                        scaled = in_upstream_tokens(predicted, tokens, item.usage.prompt_tokens)
                        usage = dataclasses.replace(item.usage, predicted_cached_tokens=scaled)
                        item = dataclasses.replace(item, usage=usage)
                    yield item
        except BackendError as err:
            if is_replica_fault(err):
                replica.mark_failed(self.router.config)
            if self.metrics:
                self.metrics.requests.inc(replica=replica.name, outcome=err.kind)
            raise
        finally:
            replica.inflight -= 1

    def _complete(self, final: Final, replica: Replica, tokens: list[int], predicted: int) -> Final:
        prompt = final.usage.prompt_tokens
        usage = dataclasses.replace(
            final.usage, predicted_cached_tokens=in_upstream_tokens(predicted, tokens, prompt),
            prompt_tokens=prompt or len(tokens))
        final = dataclasses.replace(final, usage=usage, replica=replica.name)
        if self.metrics:
            self.metrics.final(replica.name, final)
        return final


def in_upstream_tokens(predicted: int, tokens: list[int], upstream_prompt: int) -> int:
    """The shadow's prediction (tiktoken tokens) in the upstream's own token units: the same
    fraction of the prompt, so predicted and reported hits compare whatever the tokenizer."""
    if not upstream_prompt or not tokens:
        return predicted
    return min(upstream_prompt, round(predicted * upstream_prompt / len(tokens)))


def _unique(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in out:
            n += 1
            candidate = f"{name}#{n}"
        out.append(candidate)
    return out


class ProviderPools:
    """Several pools of different kinds: a request goes to the pool of its own API format
    when there is one, else to the first pool."""

    name = "upstream"

    def __init__(self, pools: Mapping[str, ReplicaPool]) -> None:
        if not pools:
            raise ValueError("need at least one pool")
        self.pools = dict(pools)

    def _pool(self, req: ChatRequest) -> ReplicaPool:
        return self.pools.get(req.provider) or next(iter(self.pools.values()))

    def models(self) -> list[str]:
        return list({m: None for p in self.pools.values() for m in p.models()})

    def kv_pages(self) -> tuple[int, int] | None:
        return None

    def stream(self, req: ChatRequest) -> AsyncGenerator[TextDelta | Final, None]:
        return self._pool(req).stream(req)

    def bind_metrics(self, registry: Registry) -> None:
        for pool in self.pools.values():
            pool.bind_metrics(registry)

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()


def make_upstream(kind: str, options: UpstreamOptions,
                  transport: httpx.AsyncBaseTransport | None = None) -> UpstreamBackend:
    """An upstream backend of `kind` ("openai" | "anthropic") for one replica."""
    if kind == "openai":
        return OpenAIUpstream(options, transport=transport)
    if kind == "anthropic":
        return AnthropicUpstream(options, transport=transport)
    raise ValueError(f"unknown upstream kind {kind!r}")


def build_upstream_backend(
    config: Any, metrics: Registry | None = None, *, router: RouterConfig | None = None,
) -> Backend:
    """The backend for `config.upstreams` (a `GatewayConfig`): one pool per kind."""
    if not config.upstreams:
        raise ValueError("no upstreams configured")
    by_kind: dict[str, list[UpstreamBackend]] = {}
    for spec in config.upstreams:
        options = UpstreamOptions(url=spec.url, api_key=config.upstream_api_keys.get(spec.kind),
                                  timeout_s=config.upstream_timeout_s)
        by_kind.setdefault(spec.kind, []).append(make_upstream(spec.kind, options))
    pools = {k: ReplicaPool(k, b, router=router, metrics=metrics) for k, b in by_kind.items()}
    if len(pools) == 1:
        return next(iter(pools.values()))
    return ProviderPools(pools)
