"""The upstream backends a configuration asks for: one `ReplicaPool` per upstream kind.

`build_upstream_backend(config, metrics)` builds one pool per kind from
`GatewayConfig.upstreams` (repeated URLs of one kind are replicas of one pool); several kinds
become `ProviderPools`, which sends a request to the pool of its own API format.
`make_upstream(kind, options)` is one replica's backend (Anthropic's Messages API or an
OpenAI-compatible server).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any

import httpx

from gateway.backends.anthropic_upstream import AnthropicUpstream
from gateway.backends.openai_upstream import OpenAIUpstream
from gateway.backends.pool import ReplicaPool
from gateway.backends.router import RouterConfig
from gateway.backends.upstream import UpstreamBackend
from gateway.backends.upstream_http import UpstreamOptions
from gateway.config import AUTO_KIND, UPSTREAM_KINDS
from gateway.metrics import Registry
from gateway.shadow_models import cache_model_for
from gateway.types import Backend, ChatRequest, Final, TextDelta
from gateway.upstream_detect import kind_from_host, log_detection


class ProviderPools:
    """Several pools of different kinds: a request goes to the pool of its own API format
    when there is one, else to the first pool."""

    name = "upstream"

    def __init__(self, pools: Mapping[str, ReplicaPool]) -> None:
        if not pools:
            raise ValueError("need at least one pool")
        self.pools = dict(pools)

    def _pool(self, req: ChatRequest) -> ReplicaPool:
        same = [p for p in self.pools.values() if p.api == req.provider]
        return same[0] if same else next(iter(self.pools.values()))

    def models(self) -> list[str]:
        return list({m: None for p in self.pools.values() for m in p.models()})

    def kv_pages(self) -> tuple[int, int] | None:
        return None

    def stream(self, req: ChatRequest) -> AsyncGenerator[TextDelta | Final, None]:
        return self._pool(req).stream(req)

    def prepare(self, req: ChatRequest) -> ChatRequest:
        return self._pool(req).prepare(req)

    def family_in_body(self, req: ChatRequest) -> bool:
        return self._pool(req).family_in_body(req)

    def bind_metrics(self, registry: Registry) -> None:
        for pool in self.pools.values():
            pool.bind_metrics(registry)

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()


def make_upstream(kind: str, options: UpstreamOptions,
                  transport: httpx.AsyncBaseTransport | None = None) -> UpstreamBackend:
    """An upstream backend of `kind` (see `UPSTREAM_KINDS`) for one replica: Anthropic's
    Messages API, or an OpenAI-compatible one (openai, vllm, sglang, llamacpp, and `auto`,
    whose server is detected at first use)."""
    if kind not in (*UPSTREAM_KINDS, AUTO_KIND):
        raise ValueError(f"unknown upstream kind {kind!r}; known: {', '.join(UPSTREAM_KINDS)}")
    if kind == "anthropic":
        return AnthropicUpstream(options, transport=transport)
    backend = OpenAIUpstream(options, transport=transport)
    if kind in ("vllm", "sglang", "llamacpp"):  # a named server is what the replica is
        backend.server_kind = kind
    return backend


def _static_kind(kind: str, url: str) -> str:
    """A bare URL of a hosted API (api.openai.com, api.anthropic.com) is known by its host;
    any other stays `auto` (probed at first use)."""
    if kind != AUTO_KIND:
        return kind
    found = kind_from_host(url)
    if found is None:
        return kind
    log_detection(httpx.URL(url).host, url, found,
                  type(cache_model_for(found.kind, url)).__name__)
    return found.kind


def build_upstream_backend(
    config: Any, metrics: Registry | None = None, *, router: RouterConfig | None = None,
) -> Backend:
    """The backend for `config.upstreams` (a `GatewayConfig`): one pool per kind."""
    if not config.upstreams:
        raise ValueError("no upstreams configured")
    by_kind: dict[str, list[UpstreamBackend]] = {}
    for spec in config.upstreams:
        kind = _static_kind(spec.kind, spec.url)
        api = "anthropic" if kind == "anthropic" else "openai"  # whose key it takes
        key = config.upstream_api_keys.get(kind) or config.upstream_api_keys.get(api)
        options = UpstreamOptions(url=spec.url, api_key=key, timeout_s=config.upstream_timeout_s)
        by_kind.setdefault(kind, []).append(make_upstream(kind, options))
    pools = {k: ReplicaPool(k, b, router=router, metrics=metrics,
                            inline_bytes=config.inline_prepare_bytes)
             for k, b in by_kind.items()}
    if len(pools) == 1:
        return next(iter(pools.values()))
    return ProviderPools(pools)
