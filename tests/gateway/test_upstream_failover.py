"""Replica pools: which upstream failures fail over to another replica, and how long a replica
stays out of routing (its own back-off, or the wait its provider asked for)."""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.backends.pool import ReplicaPool
from gateway.backends.providers import make_upstream
from gateway.backends.upstream_errors import provider_wait
from gateway.backends.upstream_http import UpstreamOptions
from gateway.types import BackendError

from .upstream_helpers import chat_request, gateway_app, records

ASK = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
ROUTE = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}


class SilentUpstream:
    """A server that accepts a connection, reads the request and never answers (a provider
    stuck on it); counts the requests it received."""

    def __init__(self) -> None:
        self.received = 0
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> SilentUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.handlers:  # a connection the gateway left open
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.received += 1
            await reader.read()  # until the gateway gives up and closes the connection
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.handlers.discard(task)


def _pool(kind: str, urls: list[str], timeout_s: float = 5.0,
          transports: list[httpx.AsyncBaseTransport] | None = None) -> ReplicaPool:
    backends = [make_upstream(kind, UpstreamOptions(url=url, name=f"r{i}", timeout_s=timeout_s),
                              transport=transports[i] if transports else None)
                for i, url in enumerate(urls)]
    return ReplicaPool(kind, backends)


@pytest.mark.parametrize(("kind", "stream"), [("openai", False), ("openai", True),
                                              ("anthropic", False)])
async def test_a_request_sent_and_timed_out_is_not_sent_to_another_replica(
        tmp_path: Path, kind: str, stream: bool) -> None:
    """A replica that took the request and does not answer within the upstream timeout: the
    client gets the timeout (504, in its format) at once, the other replica never gets the
    request (it would run, and be billed, again), and the silent replica is backed off."""
    async with SilentUpstream() as first, SilentUpstream() as second:
        pool = _pool(kind, [first.url, second.url], timeout_s=0.3)
        app = gateway_app(tmp_path, pool)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            r = await client.post(ROUTE[kind], json={**ASK, "stream": stream})
        assert first.received + second.received == 1
        assert r.status_code == 504
        error = r.json()["error"]
        assert "timed out" in error["message"]
        if kind == "openai":
            assert error["code"] == "upstream_timeout"
        else:
            assert r.json()["type"] == "error" and error["type"] == "api_error"
        failed = [rep.name for rep in pool.router.replicas if not rep.healthy]
        assert failed == ["r0" if first.received else "r1"]
        assert [row.status for row in records(app)] == [504]
        app.state.store.close()
        await pool.aclose()


def _ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={
        "id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


def _raising(exc: type[httpx.TransportError], calls: list[int]
             ) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise exc("injected", request=request)
    return handler


@pytest.mark.parametrize(("exc", "fails_over"), [
    (httpx.ConnectError, True), (httpx.ConnectTimeout, True), (httpx.PoolTimeout, True),
    (httpx.ReadTimeout, False)])
async def test_only_failures_before_the_request_was_sent_fail_over(
        exc: type[httpx.TransportError], fails_over: bool) -> None:
    """A replica that could not be reached (refused, no connection in time) never got the
    request: it goes to another replica. One that got it and timed out waiting for the answer
    is the client's 504; either way the failing replica is backed off."""
    calls: list[int] = []
    handlers: list[Any] = [_raising(exc, calls), _ok]
    pool = _pool("openai", ["http://r0.test/v1", "http://r1.test/v1"],
                 transports=[httpx.MockTransport(h) for h in handlers])
    r0, r1 = pool.router.replicas
    r1.inflight = 1  # r0, the least loaded, is chosen first
    req = chat_request([{"role": "user", "content": "hi"}])
    if fails_over:
        items = [item async for item in pool.stream(req)]
        assert items[-1].text == "fine"  # type: ignore[union-attr]
    else:
        with pytest.raises(BackendError) as info:
            async for _ in pool.stream(req):
                pass
        assert (info.value.status, info.value.kind) == (504, "upstream_timeout")
    assert len(calls) == 1 and not r0.healthy and r1.healthy
    await pool.aclose()


def _in_s(seconds: float) -> str:
    """An HTTP date `seconds` from now (whole seconds, rounded down)."""
    return email.utils.formatdate(time.time() + seconds, usegmt=True)


@pytest.mark.parametrize(("status", "headers", "back_at"), [
    (429, {"retry-after": "30"}, 30),
    (503, {"retry-after": "30"}, 30),
    (529, {"retry-after": "30"}, 30),
    (429, {"retry-after-ms": "30000"}, 30),
    (503, {"retry-after": "date +31"}, 31),  # an HTTP date 30 to 31 s ahead
    (429, {"retry-after": "3600"}, 60),  # at most the back-off's cap (max_retry_after_s: 60)
])
async def test_a_replica_stays_out_of_routing_as_long_as_its_provider_asked(
        status: int, headers: dict[str, str], back_at: float) -> None:
    """A replica whose provider refuses with a `retry-after` (seconds, an HTTP date, or
    OpenAI's `retry-after-ms`) is not sent requests until then, the other replica takes them
    (the refused request too: the provider ran nothing), and after it the replica is tried
    again. The pool's clock is injected: time passes only when the test says so."""
    calls = [0, 0]
    if headers.get("retry-after") == "date +31":
        headers = {"retry-after": _in_s(31)}

    def refusing(request: httpx.Request) -> httpx.Response:
        calls[0] += 1
        return httpx.Response(status, headers=headers, json={"error": {"message": "wait"}})

    def answering(request: httpx.Request) -> httpx.Response:
        calls[1] += 1
        return _ok(request)

    pool = _pool("openai", ["http://r0.test/v1", "http://r1.test/v1"],
                 transports=[httpx.MockTransport(refusing), httpx.MockTransport(answering)])
    now = [1000.0]
    pool.router.clock = lambda: now[0]
    pool.router.replicas[1].inflight = 1  # r0, the least loaded, is chosen when routable
    req = chat_request([{"role": "user", "content": "hi"}])
    for at, expected in [(0.0, [1, 1]), (back_at - 2, [1, 2]), (back_at + 1, [2, 3])]:
        now[0] = 1000.0 + at
        items = [item async for item in pool.stream(req)]
        assert items[-1].text == "fine"  # type: ignore[union-attr]
        assert calls == expected, at
    await pool.aclose()


def test_the_providers_wait_in_each_form() -> None:
    """`retry-after` in seconds or as an HTTP date, OpenAI's `retry-after-ms` (preferred: it
    is the more precise); nothing for a date past, a negative or unreadable value."""
    now = datetime(2015, 10, 21, 7, 27, 30, tzinfo=UTC).timestamp()
    date = "Wed, 21 Oct 2015 07:28:00 GMT"
    assert provider_wait(httpx.Headers({"retry-after": "120"}), now) == 120.0
    assert provider_wait(httpx.Headers({"retry-after": date}), now) == 30.0
    assert provider_wait(httpx.Headers({"retry-after-ms": "1500"}), now) == 1.5
    assert provider_wait(httpx.Headers({"retry-after": "9", "retry-after-ms": "8500"}),
                         now) == 8.5
    for value in ("Wed, 21 Oct 2015 07:27:00 GMT", "-5", "soon", ""):
        assert provider_wait(httpx.Headers({"retry-after": value}), now) is None, value
    assert provider_wait(httpx.Headers(), now) is None
