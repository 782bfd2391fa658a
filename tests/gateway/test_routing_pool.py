"""Replica pools: prefix-aware routing, load balance, health, failover, real network faults."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.agent_trace import agent_trace
from gateway.backends.model_listing import ModelListing
from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.router import Replica, Router, RouterConfig
from gateway.backends.upstream_http import UpstreamOptions
from gateway.shadow import NO_PROMPT, ShadowCache, ShadowConfig, prompt_tokens
from gateway.types import BackendError, Final
from prompt_lint.memo import set_caching
from tests.support import free_port

from .upstream_helpers import (
    chat_request,
    fake_replicas,
    gateway_app,
    pool_over,
    pool_over_handler,
    records,
    serving,
)

text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
chat_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                      "content": text})


@settings(max_examples=60, deadline=None)
@given(st.lists(chat_message, min_size=1, max_size=6), st.lists(chat_message, max_size=4))
def test_shadow_tokens_of_a_longer_prompt_extend_the_shorter(
    head: list[dict[str, Any]], tail: list[dict[str, Any]]
) -> None:
    short = prompt_tokens(chat_request(head))
    full = prompt_tokens(chat_request(head + tail))
    assert full[:len(short)] == short  # a grown history never changes its cached prefix
    set_caching(False)
    try:
        fresh = prompt_tokens(chat_request(head + tail))  # the chunk cache is invisible
    finally:
        set_caching(True)
    assert fresh == full


def test_shadow_prediction_respects_provider_minimum() -> None:
    shadow = ShadowCache(ShadowConfig(page_size=128, min_cached_tokens=1024))
    tokens = list(range(3000))
    shadow.record(tokens[:1000], "t")
    assert shadow.match_length(tokens, "t") == 896 and shadow.predict(tokens, "t") == 0
    shadow.record(tokens[:2000], "t")
    assert shadow.predict(tokens, "t") == 1920
    small = ShadowCache(ShadowConfig(page_size=16, max_pages=10))
    small.record(list(range(400)), "t")
    assert small.pages == 10  # least recently used pages evicted past capacity


def _router(n: int, **config: Any) -> Router:
    replicas = [Replica(f"r{i}", backend=object(), shadow=ShadowCache(ShadowConfig(page_size=4)))
                for i in range(n)]
    return Router(replicas, RouterConfig(**config))  # type: ignore[arg-type]


def test_longest_prefix_wins_above_threshold() -> None:
    router = _router(3, cache_threshold=0.5)
    a, b = list(range(100)), list(range(1000, 1100))
    router.replicas[1].shadow.record(a, "t")
    router.replicas[2].shadow.record(a[:40], "t")
    router.replicas[2].shadow.record(b, "t")
    route = router.choose(a + [7, 7, 7, 7], "t")
    assert route is not None and (route.replica.name, route.matched, route.reason) == (
        "r1", 100, "prefix")
    assert router.choose(a, "other-tenant").reason == "least_loaded"  # namespaces never share
    small = a[:8] + list(range(5000, 5100))  # 8 of 108 tokens cached: below the threshold
    route = router.choose(small, "t")
    assert route.reason == "least_loaded" and route.replica.name == "r0"  # emptiest replica


def test_unbalanced_load_goes_to_least_loaded() -> None:
    router = _router(3, balance_abs=4, balance_rel=1.5)
    tokens = list(range(64))
    router.replicas[0].shadow.record(tokens, "t")
    router.replicas[0].inflight = 10
    router.replicas[1].inflight = 3
    router.replicas[2].inflight = 5
    route = router.choose(tokens, "t")
    assert (route.replica.name, route.reason) == ("r1", "balance")
    router.replicas[0].inflight = 6  # 6 - 3 is within balance_abs: follow the cache again
    assert router.choose(tokens, "t").replica.name == "r0"


def test_unhealthy_replica_leaves_routing_and_is_retried() -> None:
    router = _router(2, retry_after_s=2.0)
    tokens = list(range(64))
    router.replicas[0].shadow.record(tokens, "t")
    router.replicas[0].mark_failed(router.config, now=100.0)
    assert router.choose(tokens, "t", now=101.0).replica.name == "r1"
    route = router.choose(tokens, "t", now=102.5)
    assert (route.replica.name, route.reason) == ("r0", "retry")
    router.replicas[0].mark_failed(router.config, now=102.5)  # back-off doubles
    assert router.replicas[0].retry_at == pytest.approx(106.5)
    router.replicas[1].mark_failed(router.config, now=103.0)
    route = router.choose(tokens, "t", now=104.0)  # all down: the one due first is tried
    assert route.replica.name == "r1"
    router.replicas[0].mark_ok()
    assert router.replicas[0].healthy and router.choose(tokens, "t", now=104.0).replica.name == "r0"


async def test_failover_and_recovery(tmp_path: Path) -> None:
    apps = fake_replicas(2)
    apps[0].state.replica.config.fail_status = 500
    pool = pool_over(apps, router=RouterConfig(retry_after_s=0.05, max_retry_after_s=0.05))
    app = gateway_app(tmp_path, pool)
    r0, r1 = pool.router.replicas
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        for i in range(4):
            r = await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": f"job {i} " * 50}]})
            assert r.status_code == 200
        assert not r0.healthy and len(apps[0].state.replica.config.bodies) == 1
        metrics = (await client.get("/metrics")).text
        assert 'prefixgate_upstream_replica_healthy{replica="r0"} 0' in metrics
        apps[0].state.replica.config.fail_status = None
        await asyncio.sleep(0.06)  # the back-off is over: r0 is tried again (emptiest replica)
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "after the outage"}]})
        assert r.status_code == 200 and r0.healthy and r1.healthy
        metrics = (await client.get("/metrics")).text
    assert 'prefixgate_upstream_replica_healthy{replica="r0"} 1' in metrics
    assert 'prefixgate_upstream_routes_total{reason="retry",replica="r0"} 1' in metrics
    assert [row.replica for row in records(app)][-1] == "r0"
    app.state.store.close()
    await pool.aclose()


async def test_real_timeout_and_refused_connection(tmp_path: Path) -> None:
    slow = fake_replicas(1, delay_s=1.0)[0]
    with serving(slow) as server:
        backends = [
            make_upstream("openai", UpstreamOptions(url=f"{server.url}/v1", timeout_s=0.3)),
            make_upstream("openai", UpstreamOptions(
                url=f"http://127.0.0.1:{free_port()}/v1", timeout_s=0.3)),
        ]
        for backend in backends:
            pool = ReplicaPool("openai", [backend])
            app = gateway_app(tmp_path / backend.replica.replace(":", "_"), pool)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw") as client:
                r = await client.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}]})
                assert (await client.get("/healthz")).status_code == 200
            expected = (504, "upstream_timeout") if backend is backends[0] else (
                502, "upstream_unavailable")
            assert (r.status_code, r.json()["error"]["code"]) == expected
            assert [row.status for row in records(app)] == [expected[0]]
            assert not pool.router.replicas[0].healthy
            app.state.store.close()
            await pool.aclose()


async def _replay(policy: str, n_replicas: int, trace: list[Any]) -> tuple[float, list[int]]:
    """Hit rate the fake replicas themselves reported, and requests served per replica."""
    apps = fake_replicas(n_replicas)
    pool = pool_over(apps, router=RouterConfig(policy=policy))  # type: ignore[arg-type]
    for item in trace:
        req = chat_request(item.body["messages"], tools=tuple(item.body["tools"]),
                           body=item.body)
        final = [x async for x in pool.stream(req)][-1]
        assert isinstance(final, Final)
    await pool.aclose()
    fakes = [a.state.replica for a in apps]
    hit = sum(f.cached_tokens for f in fakes) / sum(f.prompt_tokens for f in fakes)
    return hit, [f.requests for f in fakes]


async def test_prefix_routing_beats_round_robin() -> None:
    trace = agent_trace(sessions=8, turns=6, system_words=300, task_words=150, output_words=80)
    ideal, _ = await _replay("prefix", 1, trace)  # one replica that sees everything
    prefix, served = await _replay("prefix", 4, trace)
    round_robin, _ = await _replay("round_robin", 4, trace)
    assert prefix > round_robin + 0.15, (prefix, round_robin)
    assert prefix >= 0.95 * ideal, (prefix, ideal)
    assert sum(served) == len(trace)


async def test_pool_error_before_output_is_not_retried_for_client_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad model"}})

    backends = [make_upstream("openai", UpstreamOptions(url=f"http://r{i}.test/v1", name=f"r{i}"),
                              transport=httpx.MockTransport(handler)) for i in range(2)]
    pool = ReplicaPool("openai", backends)
    with pytest.raises(BackendError) as info:
        async for _ in pool.stream(chat_request([{"role": "user", "content": "x"}])):
            pass
    assert info.value.status == 400 and "bad model" in info.value.message
    assert all(r.healthy for r in pool.router.replicas)  # the request's fault, not the replica's
    await pool.aclose()


async def test_create_app_builds_one_pool_per_kind_from_config(tmp_path: Path) -> None:
    from gateway.app import create_app
    from gateway.config import GatewayConfig, UpstreamSpec

    apps = fake_replicas(2)
    with serving(apps[0]) as s0, serving(apps[1]) as s1:
        config = GatewayConfig(
            db_url=f"sqlite:///{tmp_path / 'gw.db'}", lint_mode="off",
            upstreams=tuple(UpstreamSpec("openai", f"{s.url}/v1") for s in (s0, s1)),
            upstream_api_keys={"openai": "sk-test"}, upstream_timeout_s=5.0)
        app = create_app(config)
        pool = app.state.backend
        assert isinstance(pool, ReplicaPool) and len(pool.router.replicas) == 2
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            for session in range(4):
                for turn in range(2):
                    r = await client.post("/v1/chat/completions", json={
                        "model": "any-model", "messages": [
                            {"role": "system", "content": f"agent {session} " * 200},
                            *[{"role": "user", "content": f"turn {t}"} for t in range(turn + 1)]]})
                    assert r.status_code == 200, r.text
            metrics = (await client.get("/metrics")).text
        rows = records(app)
        await pool.aclose()
        app.state.store.close()
    for replica in pool.router.replicas:
        assert f'prefixgate_upstream_replica_healthy{{replica="{replica.name}"}} 1' in metrics
    second_turns = rows[1::2]  # each session's second turn follows its first to one replica
    assert all(r.replica == first.replica for r, first in zip(second_turns, rows[::2], strict=True))
    assert all(r.reported_cached_tokens and r.reported_cached_tokens > 0 for r in second_turns)
    assert {r.replica for r in rows} == {r.name for r in pool.router.replicas}


def test_prediction_is_rescaled_to_upstream_tokens() -> None:
    from gateway.backends.predicted_usage import in_upstream_tokens

    tokens = list(range(1000))
    assert in_upstream_tokens(500, tokens, 1200) == 600  # half the prompt, in upstream units
    assert in_upstream_tokens(500, tokens, 0) == 500  # upstream did not say: shadow units
    assert in_upstream_tokens(1000, tokens, 990) == 990


@pytest.mark.parametrize("stream", [False, True])
async def test_shadow_bookkeeping_follows_the_answer_and_is_never_lost(stream: bool) -> None:
    """The shadow records a prompt, learns from its report and counts it in the metrics once
    the item it follows is handed on (the answer is not held for them), and a consumer that
    closes the stream at its Final, as a whole answer's does, still leaves all of it done."""
    from gateway.metrics import Registry

    pool = pool_over(fake_replicas(1))
    pool.bind_metrics(Registry())
    assert pool.metrics is not None
    shadow = pool.router.replicas[0].shadow
    req = chat_request([{"role": "system", "content": "You follow the house rules. " * 80},
                        {"role": "user", "content": "hello"}], stream=stream)
    tokens = prompt_tokens(req)
    reference = ShadowCache(shadow.config)  # what the shadow holds once the prompt is recorded
    reference.record(tokens, "t")
    stream_items = pool.stream(req)
    item = await anext(stream_items)
    assert shadow.match_length(tokens, "t") == 0  # handed on before the bookkeeping
    recorded = reference.match_length(tokens, "t")
    if stream:  # recorded once the first chunk is on its way and the next is asked for
        while not isinstance(item, Final):
            item = await anext(stream_items)
        assert shadow.match_length(tokens, "t") == recorded > 0
    assert isinstance(item, Final)
    assert pool.metrics.prompt.get(replica="r0") == 0  # the Final's figures: not yet counted
    await stream_items.aclose()
    assert shadow.match_length(tokens, "t") == recorded > 0
    assert pool.metrics.prompt.get(replica="r0") == item.usage.prompt_tokens > 0
    assert pool.metrics.requests.get(replica="r0", outcome="ok") == 1
    await pool.aclose()


class _Counting(ShadowCache):
    """A shadow that counts the prompts it is asked to score."""

    asked = 0

    def match_length(self, tokens: Any, namespace: str) -> int:
        _Counting.asked += 1
        return super().match_length(tokens, namespace)


@pytest.mark.parametrize(("inflight", "failed"), [
    ((0,), ()), ((3,), (0,)), ((2, 0, 1), ()), ((12, 1, 4), ()), ((0, 0, 0), (0,)),
    ((5, 5), (0, 1)),
])
def test_an_empty_prompt_is_routed_as_scoring_it_would_without_asking_a_shadow(
        inflight: tuple[int, ...], failed: tuple[int, ...]) -> None:
    """A prompt whose tokens come later (one replica that sends first) is routed without
    scoring: the same replica and reason as scoring a prompt no shadow holds."""
    routers = []
    for _ in range(2):
        replicas = [Replica(f"r{i}", backend=object(),  # type: ignore[arg-type]
                            shadow=_Counting(ShadowConfig(page_size=4)), inflight=n)
                    for i, n in enumerate(inflight)]
        for i, r in enumerate(replicas):
            r.shadow.record(list(range(100 * i, 100 * i + 8 * (i + 1))), "t")
            if i in failed:
                r.mark_failed(RouterConfig(), now=0.0)
        routers.append(Router(replicas, RouterConfig(balance_abs=4)))
    for turn in range(3):
        _Counting.asked = 0
        empty = routers[0].choose(NO_PROMPT, "t", now=1.0)
        assert _Counting.asked == 0
        scored = routers[1].choose(list(range(9000, 9050)), "t", now=1.0)
        assert empty is not None and scored is not None
        assert (empty.replica.name, empty.matched, empty.reason) == (
            scored.replica.name, scored.matched, scored.reason), turn


async def test_v1_models_asks_each_replica_once_per_listing(tmp_path: Path) -> None:
    """Concurrent GET /v1/models share one listing, asked of the replica once; it is asked
    again only once the listing is older than its time to live."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"data": [{"id": "m-1"}, {"id": "m-2"}]})

    pool = pool_over_handler(handler)
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        answers = await asyncio.gather(*(client.get("/v1/models") for _ in range(20)))
        assert asked == ["/v1/models"]
        pool._listing.ttl_s = 0.0  # the listing is now stale
        again = await client.get("/v1/models")
    assert asked == ["/v1/models"] * 2
    for r in [*answers, again]:
        assert [m["id"] for m in r.json()["data"]] == ["m-1", "m-2"]
    app.state.store.close()
    await pool.aclose()


async def test_a_listing_is_the_union_of_the_replicas_in_their_order() -> None:
    """Replicas are asked at once (a slow one does not queue the others) and their ids are
    merged in replica order, each once."""
    started: list[str] = []

    def lister(name: str, ids: list[str], delay: float) -> Any:
        async def ask() -> list[str]:
            started.append(name)
            await asyncio.sleep(delay)
            return ids
        return ask

    listing = ModelListing([lister("slow", ["a", "b"], 0.2), lister("fast", ["b", "c"], 0.0)])
    first, second = await asyncio.gather(listing.ids(), listing.ids())
    assert first == second == ["a", "b", "c"] and started == ["slow", "fast"]
