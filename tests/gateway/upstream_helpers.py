"""Helpers for the upstream, routing and dashboard tests: fake replicas, gateways, a server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from gateway.app import create_app
from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.router import RouterConfig
from gateway.backends.upstream_http import UpstreamOptions
from gateway.config import GatewayConfig
from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream
from gateway.stats import RecordStore, RequestRecord
from gateway.types import ChatRequest, SamplingOptions
from tests.support import ServerThread, serve


async def slow_words(sent: list[int] | None = None, count: int = 200,
                     pause_s: float = 0.02) -> AsyncIterator[bytes]:
    """An OpenAI-compatible stream of `count` one-word chunks `pause_s` apart, slow enough for a
    client to leave it mid-way; `sent[0]` counts the chunks yielded."""
    for i in range(count):
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": f"w{i} "},
                              "finish_reason": None}]}
        if sent is not None:
            sent[0] += 1
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        await asyncio.sleep(pause_s)


def fake_replicas(n: int, **config: Any) -> list[Any]:
    """`n` fake OpenAI-compatible replica apps (each with its own cache)."""
    return [create_fake_upstream(FakeUpstreamConfig(name=f"r{i}", **config)) for i in range(n)]


def pool_over(apps: list[Any], *, kind: str = "openai", router: RouterConfig | None = None,
              timeout_s: float = 5.0, api_key: str | None = None) -> ReplicaPool:
    """A replica pool whose replicas are in-process ASGI apps (`http://rN.test/v1`)."""
    backends = [make_upstream(kind, UpstreamOptions(
        url=f"http://r{i}.test/v1", name=f"r{i}", timeout_s=timeout_s, api_key=api_key),
        transport=httpx.ASGITransport(app=app)) for i, app in enumerate(apps)]
    return ReplicaPool(kind, backends, router=router)


def pool_over_handler(handler: Any, *, kind: str = "openai", timeout_s: float = 5.0,
                      api_key: str | None = None, url: str = "http://up.test/v1",
                      name: str | None = "up") -> ReplicaPool:
    """A one-replica pool over an `httpx.MockTransport` handler (`name` None: the replica is
    named host:port, as `--upstream` names it)."""
    backend = make_upstream(kind, UpstreamOptions(url=url, name=name, timeout_s=timeout_s,
                                                  api_key=api_key),
                            transport=httpx.MockTransport(handler))
    return ReplicaPool(kind, [backend])


def gateway_app(tmp_path: Path, pool: ReplicaPool, **config: Any) -> Any:
    """The gateway app over `pool`, its metrics bound to the app's registry."""
    cfg = GatewayConfig(db_url=f"sqlite:///{tmp_path / 'gw.db'}", lint_mode="off", **config)
    app = create_app(cfg, backend=pool)
    pool.bind_metrics(app.state.metrics)
    return app


def records(app: Any) -> list[RequestRecord]:
    """Every stored record, oldest first."""
    store: RecordStore = app.state.store
    store.flush()
    with store.session() as session:
        return list(session.query(RequestRecord).order_by(RequestRecord.id))


def chat_request(messages: list[dict[str, Any]], *, stream: bool = False, namespace: str = "t",
                 tools: tuple[dict[str, Any], ...] = (), family: str | None = None,
                 body: dict[str, Any] | None = None) -> ChatRequest:
    """A neutral request as the OpenAI route would build it."""
    return ChatRequest(
        request_id="req", provider="openai", model="fake", messages=tuple(messages), tools=tools,
        options=SamplingOptions(), stream=stream, tenant=namespace, namespace=namespace,
        body=body or {"model": "fake", "messages": messages, "tools": list(tools)},
        family=family)


def serving(app: Any) -> AbstractContextManager[ServerThread]:
    """A real server for `app` without lifespan events (fake replicas need none)."""
    return serve(app, lifespan="off")


def seed_records(store: RecordStore, now: datetime | None = None) -> list[RequestRecord]:
    """A day of varied records: tenants, models, replicas, errors, lint ids, families."""
    now = now or datetime.now(UTC)
    rows: list[RequestRecord] = []
    for i in range(60):
        ok = i % 13 != 5
        cut = i % 17 == 8  # a client gone mid-stream: a 499 that keeps the work it was given
        prompt = 1000 + 37 * i
        cached = (prompt * (i % 7)) // 8 if ok else 0
        rows.append(RequestRecord(
            ts=now - timedelta(minutes=23 * i + 1), request_id=f"r{i}",
            tenant=("acme", "globex", "initech")[i % 3],
            model=("gpt-4o-2024-08-06", "claude-sonnet-4-20250514", "local-model")[i % 3],
            backend="openai", replica=f"10.0.0.{i % 4}:8000", provider="openai",
            route="chat.completions",
            status=(499 if cut else 200) if ok else (502 if i % 2 else 422),
            error=None if ok else "upstream failed", prompt_tokens=prompt if ok else 0,
            cached_tokens=cached, predicted_cached_tokens=cached + 16 * (i % 3) if ok else None,
            reported_cached_tokens=cached if ok else None,
            completion_tokens=(3 if cut else 20) if ok else 0,
            latency_ms=100.0 + i, prefill_saved_ms=0.5 * cached,
            lint_ids=("PL001,PL004", "PL004", "")[i % 3], family=f"family-{i % 5}",
            stream=bool(i % 2)))
    for row in rows:
        store.add(row)
    store.flush()
    return rows
