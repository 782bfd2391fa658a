"""Issue 17, items 5 and 7-10 through the real app: the event loop stays free, abandoned
requests free the backend, admission (429/503, fairness, max_tokens cap), malformed bodies as
400 in the caller's format, and no key in a URL or a log line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from gateway import access_log, dashboard
from gateway.admission import Admission, AdmissionConfig, Overloaded
from gateway.sessions import SESSION_COOKIE
from gateway.stats import RequestRecord
from gateway.types import ChatRequest, Final, TextDelta, Usage
from tests.support import ServerThread, free_port

from .gateway_fakes import FAKE_MODEL, asgi_client

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello there"}]}
MESSAGES = {"model": FAKE_MODEL, "max_tokens": 16,
            "messages": [{"role": "user", "content": "hello there"}]}
ROUTES = [("/v1/chat/completions", CHAT, "openai"), ("/v1/messages", MESSAGES, "anthropic")]
ADMIN = "admin-0123456789"
KEYS = {"key-alice": "alice", "key-bob": "bob"}


def records(app: Any) -> list[RequestRecord]:
    app.state.store.flush()
    with app.state.store.session() as session:
        return list(session.scalars(select(RequestRecord).order_by(RequestRecord.id)))


def assert_error_format(response: httpx.Response, provider: str, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    if provider == "anthropic":
        assert body["type"] == "error" and body["error"]["message"]
        return str(body["error"]["message"])
    assert body["error"]["type"] and body["error"]["message"]
    return str(body["error"]["message"])


class FakeEmbedded:
    """What the test backends share: one model, no KV pages to report, nothing to close."""

    name: str = "embedded"

    def models(self) -> list[str]:
        return [FAKE_MODEL]

    def kv_pages(self) -> tuple[int, int] | None:
        return None

    async def aclose(self) -> None:
        return None


@dataclass
class GatedBackend(FakeEmbedded):
    """Holds every request before its first token until `gate` is set (a busy engine)."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    started: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    async def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        self.started.append(req.tenant)
        try:
            await self.gate.wait()
            yield TextDelta("ok", usage=Usage(1, 0, 0))
            self.finished.append(req.request_id)
            yield Final("ok", (), "stop", Usage(1, 1, 0))
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(req.request_id)
            raise


# ------------------------------------------------------------------ 9: malformed input


def _nested(levels: int) -> bytes:
    return b'{"model":"fake-echo","x":' + b"[" * levels + b"]" * levels + b"}"


MALFORMED = [
    _nested(10_000),  # the C parser's recursion guard
    _nested(200),  # parses, but deeper than max_json_depth
    b'{"model":"fake-echo","max_tokens":' + b"7" * 5000 + b"}",  # int too long to convert
    b'{"model":"fake-echo","temperature":1' + b"0" * 40 + b"}",  # outside 64 bits
    b'{"model":"fake-echo","top_p":1e999}',  # overflows to infinity
    b'{"model":"fake-echo","top_p":NaN}',
    b"\xff\xfe not even text",
    b'{"model":"fake-echo","messages":[{"role":"user","content":"lone \\ud800"}]}',
]


@pytest.mark.parametrize(("route", "good", "provider"), ROUTES)
async def test_malformed_bodies_are_400_in_the_callers_format(make_fake_app, route, good,
                                                              provider) -> None:
    app = make_fake_app()
    async with asgi_client(app) as http:
        for raw in MALFORMED:
            r = await http.post(route, content=raw, headers={"content-type": "application/json"})
            message = assert_error_format(r, provider, 400)
            assert "body" in message or "JSON" in message
        assert (await http.post(route, json=good)).status_code == 200
    assert [r.status for r in records(app)] == [400] * len(MALFORMED) + [200]


async def test_max_tokens_is_capped_on_the_server(make_fake_app, fake_backend) -> None:
    app = make_fake_app(max_tokens_cap=8)
    async with asgi_client(app) as http:
        for route, body in (("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}),
                            ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**9}),
                            ("/v1/messages", {**MESSAGES, "max_tokens": 10**9})):
            assert (await http.post(route, json=body)).status_code == 200
    assert [r.options.max_tokens for r in fake_backend.seen] == [8, 8, 8]


# ------------------------------------------------------------------ 8: admission


async def test_tenant_rate_limit_is_429_with_retry_after(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, tenant_rate_per_s=0.01, tenant_burst=2)
    async with asgi_client(app) as http:
        alice = {"authorization": "Bearer key-alice"}
        codes = [(await http.post("/v1/chat/completions", json=CHAT, headers=alice)).status_code
                 for _ in range(2)]
        r = await http.post("/v1/chat/completions", json=CHAT, headers=alice)
        assert_error_format(r, "openai", 429)
        assert int(r.headers["retry-after"]) >= 1
        r = await http.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "key-alice"})
        assert_error_format(r, "anthropic", 429)
        bob = await http.post("/v1/chat/completions", json=CHAT,
                              headers={"authorization": "Bearer key-bob"})
    assert codes == [200, 200] and bob.status_code == 200
    assert sorted(r.status for r in records(app)) == [200, 200, 200, 429, 429]


async def test_tenant_concurrency_429_and_full_queue_503(make_fake_app) -> None:
    backend = GatedBackend()
    app = make_fake_app(api_keys=KEYS, tenant_max_concurrency=2, max_concurrency=2, max_queue=1)
    app.state.gateway.backend = backend
    alice = {"authorization": "Bearer key-alice"}
    bob = {"authorization": "Bearer key-bob"}
    async with asgi_client(app) as http:
        def post(headers: dict[str, str]) -> Any:
            return asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT,
                                                   headers=headers))
        held = [post(alice), post(alice)]
        while len(backend.started) < 2:
            await asyncio.sleep(0.01)
        over = await http.post("/v1/chat/completions", json=CHAT, headers=alice)
        assert_error_format(over, "openai", 429)
        queued = post(bob)  # both slots busy: bob waits in the queue
        while app.state.gateway.admission.queued < 1:
            await asyncio.sleep(0.01)
        full = await http.post("/v1/chat/completions", json=CHAT, headers=bob)
        assert_error_format(full, "openai", 503)
        assert "retry-after" in full.headers
        assert full.json()["error"]["code"] == "overloaded_error"
        full = await http.post("/v1/messages", json=MESSAGES, headers=bob)
        assert_error_format(full, "anthropic", 503)
        assert full.json()["error"]["type"] == "overloaded_error"  # Anthropic's own type
        backend.gate.set()
        done = await asyncio.gather(*held, queued)
    assert [r.status_code for r in done] == [200, 200, 200]
    assert app.state.gateway.admission.running == 0


async def test_bodies_still_arriving_count_toward_the_tenants_limit(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, tenant_max_concurrency=2)
    body = json.dumps(CHAT).encode()
    arrived = asyncio.Event()
    begun: list[int] = []

    async def slow_body() -> AsyncIterator[bytes]:
        begun.append(1)  # the gateway is reading this body
        yield body[:10]
        await arrived.wait()  # the rest comes only when the test lets it
        yield body[10:]

    alice = {"authorization": "Bearer key-alice"}
    async with asgi_client(app) as http:
        slow = [asyncio.ensure_future(http.post("/v1/chat/completions", content=slow_body(),
                                                headers=alice)) for _ in range(2)]
        while len(begun) < 2:
            await asyncio.sleep(0.01)
        over = await http.post("/v1/chat/completions", json=CHAT, headers=alice)
        assert_error_format(over, "openai", 429)
        assert int(over.headers["retry-after"]) >= 1
        bob = await http.post("/v1/chat/completions", json=CHAT,
                              headers={"authorization": "Bearer key-bob"})
        assert bob.status_code == 200
        arrived.set()
        assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
    assert sorted(r.status for r in records(app)) == [200, 200, 200, 429]


async def test_freed_slots_go_round_robin_across_tenants() -> None:
    admission = Admission(AdmissionConfig(max_concurrency=1, max_queue=100))
    order: list[str] = []
    first = await admission.acquire("a")

    async def one(tenant: str) -> None:
        slot = await admission.acquire(tenant)
        order.append(tenant)
        await asyncio.sleep(0)
        slot.release()

    tasks = [asyncio.ensure_future(one("a")) for _ in range(5)]
    await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(one("b")), asyncio.ensure_future(one("c"))]
    await asyncio.sleep(0)
    first.release()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c", "a", "a", "a", "a"]  # b and c do not wait behind all of a
    assert (admission.running, admission.queued, admission.in_flight) == (0, 0, {})


async def test_overloaded_is_an_error_with_retry_after() -> None:
    admission = Admission(AdmissionConfig(max_concurrency=1, max_queue=0))
    slot = await admission.acquire("a")
    with pytest.raises(Overloaded) as info:
        await admission.acquire("b")
    assert info.value.status == 503 and info.value.retry_after >= 1
    slot.release()
    slot.release()  # idempotent
    assert admission.running == 0


# ------------------------------------------------------------------ 7: disconnects


async def _abandon(app: Any, body: dict[str, Any], until: Any,
                   cancel: bool = False) -> list[dict[str, Any]]:
    """Send `body` over raw ASGI and disconnect once `until()` is true (`cancel`: cancel the
    app's task instead, as a server shutting down does); the messages sent."""
    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"gw")],
             "client": ("127.0.0.1", 1), "server": ("gw", 80), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    while not until():
        await asyncio.sleep(0.01)
    if cancel:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sent
    gone.set()
    await asyncio.wait_for(task, 10)
    return sent


@pytest.mark.parametrize("stream", [False, True])
async def test_client_gone_before_the_first_token_aborts_and_records_499(make_fake_app,
                                                                         stream) -> None:
    backend = GatedBackend()
    app = make_fake_app()
    app.state.gateway.backend = backend
    async with asgi_client(app):  # runs the lifespan
        sent = await _abandon(app, {**CHAT, "stream": stream}, lambda: backend.started)
    assert len(backend.aborted) == 1 and not backend.finished
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] in ([499], [])
    assert [(r.status, r.error) for r in records(app)] == [
        (499, "client disconnected before the answer")]
    assert app.state.gateway.admission.running == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("queued", [False, True])
async def test_a_request_cancelled_by_the_server_keeps_its_record(make_fake_app, stream,
                                                                  queued) -> None:
    """A handler cancelled from outside (a server's forced shutdown) before its answer, while
    waiting for the backend or queued for a slot, still writes its one record and gives its
    slot back; the backend's work is aborted."""
    backend = GatedBackend()
    app = make_fake_app(max_concurrency=1)
    app.state.gateway.backend = backend
    admission = app.state.gateway.admission
    body = {**CHAT, "stream": stream}
    async with asgi_client(app) as http:
        if not queued:
            await _abandon(app, body, lambda: backend.started, cancel=True)
            assert len(backend.aborted) == 1
        else:
            running = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT))
            while not backend.started:
                await asyncio.sleep(0.01)
            await _abandon(app, body, lambda: admission.queued == 1, cancel=True)
            assert admission.queued == 0
            backend.gate.set()
            assert (await running).status_code == 200
        metrics = (await http.get("/metrics")).text
    rows = records(app)
    assert sorted((r.status, r.error) for r in rows) == sorted(
        [(499, "cancelled")] + ([(200, None)] if queued else []))
    assert admission.running == 0 and admission.queued == 0
    assert "\nprefixgate_requests_in_flight 0.0\n" in metrics


@dataclass
class MidStreamBackend(GatedBackend):
    """Sends its first piece of text, then holds the rest until `gate` is set."""

    async def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        yield TextDelta("part", usage=Usage(3, 0, 0), tokens=1)
        async for item in super().stream(req):
            yield item


def test_a_shutdown_past_its_grace_records_every_request_in_flight(make_fake_app,
                                                                   caplog) -> None:
    """SIGTERM (the server's should_exit) with requests that will not finish: after the
    graceful timeout they are cancelled and each still writes its one record (a whole
    request waiting for its first token, a stream mid-way) before the process exits."""
    backend = MidStreamBackend()
    app = make_fake_app()
    app.state.gateway.backend = backend
    server = ServerThread(app, graceful_timeout_s=0.5)
    got: dict[str, Any] = {}

    def whole() -> None:
        with contextlib.suppress(httpx.HTTPError):
            got["whole"] = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30)

    with server:
        client = threading.Thread(target=whole)
        client.start()
        with httpx.stream("POST", server.url + "/v1/chat/completions",
                          json={**CHAT, "stream": True}, timeout=30) as stream:
            assert any("part" in chunk for chunk in stream.iter_text())  # the first text
            while len(backend.started) < 2:
                time.sleep(0.01)
            server.server.should_exit = True
            server.thread.join(timeout=20)
        client.join(timeout=20)
    assert not server.thread.is_alive()
    engine = create_engine(app.state.gateway.config.db_url)
    with Session(engine) as session:
        rows = list(session.scalars(select(RequestRecord)))
    engine.dispose()
    assert sorted((r.status, r.completion_tokens) for r in rows) == [(499, 1), (499, 1)]
    assert len(backend.aborted) == 2 and not backend.finished
    assert "closing a backend stream failed" not in caplog.text  # each closed cleanly


async def test_client_gone_while_queued_leaves_the_queue(make_fake_app) -> None:
    backend = GatedBackend()
    app = make_fake_app(max_concurrency=1)
    app.state.gateway.backend = backend
    admission = app.state.gateway.admission
    async with asgi_client(app) as http:
        running = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT))
        while not backend.started:
            await asyncio.sleep(0.01)
        await _abandon(app, CHAT, lambda: admission.queued == 1)
        assert admission.queued == 0 and backend.started == ["default"]
        backend.gate.set()
        assert (await running).status_code == 200
    assert sorted(r.status for r in records(app)) == [200, 499]
    assert admission.running == 0


@pytest.mark.parametrize(("route", "good", "provider"), ROUTES)
async def test_a_stream_whose_head_fails_to_render_ends_cleanly(make_fake_app, fake_backend,
                                                                route, good, provider) -> None:
    """A renderer that fails on a stream's head (after the backend's first item) is the
    gateway's 500 in the caller's format, with one record, its slot given back and the
    backend stream closed (an engine request is aborted), not a bare 500 that leaks them."""
    import dataclasses

    app = make_fake_app()

    def failing_head(req: ChatRequest, early: Usage | None) -> tuple[Any, bytes]:
        raise RuntimeError("renderer bug")

    app.api[route] = dataclasses.replace(app.api[route], stream_start=failing_head)
    async with asgi_client(app) as http:
        response = await http.post(route, json={**good, "stream": True})
    assert "internal gateway error" in assert_error_format(response, provider, 500)
    assert [r.status for r in records(app)] == [500]
    assert app.state.gateway.admission.running == 0
    assert len(fake_backend.seen) == 1 and fake_backend.aborted == [
        fake_backend.seen[0].request_id]


# ------------------------------------------------------------------ 5: the loop stays free


async def test_lint_runs_off_the_event_loop(make_fake_app) -> None:
    """Past `inline_prepare_bytes` (here 0: every body) lint runs in a worker thread; the
    small bodies that run inline are tests/gateway/test_inline_prepare.py's."""
    app = make_fake_app(lint_mode="report", inline_prepare_bytes=0)
    gw = app.state.gateway
    release = threading.Event()
    entered = threading.Event()
    real_run = gw.lint.run

    def slow_run(*args: Any) -> Any:
        entered.set()
        release.wait(30)
        return real_run(*args)

    gw.lint.run = slow_run
    async with asgi_client(app) as http:
        pending = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        health = await http.get("/healthz")  # answered while lint is still running
        assert health.status_code == 200 and not pending.done()
        release.set()
        assert (await pending).status_code == 200


class QuickBackend(FakeEmbedded):
    """Answers at once, whatever the prompt size."""

    async def stream(self, req: ChatRequest) -> AsyncIterator[TextDelta | Final]:
        yield Final("ok", (), "stop", Usage(len(req.messages), 1, 0))


def test_the_gateway_knows_whether_its_current_backend_prepares(make_fake_app) -> None:
    """`Gateway.preparing` follows the backend it serves with, also after a swap."""
    from .upstream_helpers import fake_replicas, pool_over

    gw = make_fake_app().state.gateway
    assert gw.preparing is None  # the fake engine does not prepare requests
    pool = pool_over(fake_replicas(1))
    gw.backend = pool
    assert gw.preparing is pool
    gw.backend = QuickBackend()
    assert gw.preparing is None


async def test_a_100k_message_body_never_freezes_healthz(make_fake_app) -> None:
    app = make_fake_app(lint_mode="report", lint_max_messages=200_000,
                        max_body_bytes=8 << 20)
    app.state.gateway.backend = QuickBackend()
    messages = [{"role": ("user", "assistant")[i % 2], "content": chr(97 + i % 26)}
                for i in range(100_000)]
    async with asgi_client(app, timeout=300) as http:
        big = asyncio.ensure_future(http.post("/v1/chat/completions",
                                              json={"model": FAKE_MODEL, "messages": messages}))
        await asyncio.sleep(0.5)
        for _ in range(3):
            health = await asyncio.wait_for(http.get("/healthz"), 1.0)
            assert health.status_code == 200
        assert (await big).status_code == 200


# ------------------------------------------------------------------ 10: secrets


async def test_dashboard_login_sets_an_httponly_session_cookie(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    async with asgi_client(app) as http:
        login = await http.get("/dashboard")
        assert login.status_code == 401 and 'type="password"' in login.text
        assert 'method="post"' in login.text and ADMIN not in login.text
        wrong = await http.post("/dashboard/login", data={"key": "key-alice"})
        assert wrong.status_code == 401 and SESSION_COOKIE not in wrong.headers.get(
            "set-cookie", "")
        ok = await http.post("/dashboard/login", data={"key": ADMIN})
        assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and ADMIN not in cookie
        assert (await http.get("/dashboard")).status_code == 200  # the cookie jar sends it
        assert (await http.get("/api/stats")).status_code == 200
        http.cookies.set(SESSION_COOKIE, "9999999999.forged")
        assert (await http.get("/api/stats")).status_code == 401


async def test_a_hostile_sign_in_form_is_a_wrong_key_not_a_500(make_fake_app,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(dashboard, "LOGIN_READ_S", 0.2, raising=False)
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN)

    async def slow_form() -> AsyncIterator[bytes]:
        yield b"key="
        await asyncio.sleep(1.0)  # past the form's deadline, then the right key
        yield ADMIN.encode()

    many = {"key": ADMIN, **{f"field{i}": "x" for i in range(9)}}
    async with asgi_client(app) as http:
        for form in ({"data": many}, {"content": slow_form()}):
            answer = await http.post("/dashboard/login", **form)  # type: ignore[arg-type]
            assert answer.status_code == 401 and "Wrong admin key." in answer.text
            assert SESSION_COOKIE not in answer.headers.get("set-cookie", "")
        ok = await http.post("/dashboard/login", data={"key": ADMIN})
        assert ok.status_code == 303


async def test_metrics_need_a_key_whenever_any_key_exists(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS)  # tenant keys, no admin key
    async with asgi_client(app) as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers={"x-api-key": "nope"})).status_code == 401
        assert (await http.get("/metrics", headers={"x-api-key": "key-bob"})).status_code == 200
    admin = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    async with asgi_client(admin) as http:
        refused = await http.get("/metrics", headers={"x-api-key": "key-bob"})
        assert refused.status_code == 401  # a tenant's key is not the admin key it names
        assert refused.json()["error"]["message"] == "/metrics needs the admin key"
        assert (await http.get("/metrics", headers={"x-api-key": ADMIN})).status_code == 200


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_no_key_in_any_log_line(make_fake_app) -> None:
    app = make_fake_app(api_keys=KEYS, admin_key=ADMIN)
    port = free_port()
    # log_level info: uvicorn writes an access line per request (configured here, before the
    # handler is attached, because uvicorn's logging setup replaces handlers)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info",
                                           access_log=True))
    handler = _Lines()
    # the gateway's side: uvicorn and prefixgate loggers (not the test client's httpx log)
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error", "prefixgate",
                                              "starlette")]
    for lg in loggers:
        lg.addHandler(handler)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            http.get(f"/dashboard?key={ADMIN}")
            http.get(f"/metrics?key={ADMIN}&x=1")
            http.get(f"/api/stats?window=60&api_key={ADMIN}")
            http.get("/dashboard", params={"token": "key-alice"})
            http.get("/v1/models", params={"q": "key-alice"})  # a key under any name
            http.post("/dashboard/login", data={"key": ADMIN})
            http.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "key-alice"})
    finally:
        server.should_exit = True
        thread.join(30)
        for lg in loggers:
            lg.removeHandler(handler)
    access = [line for line in handler.lines if "HTTP/1.1" in line]
    assert len(access) >= 7, handler.lines  # the access log really ran
    assert any("/dashboard?key=" in line for line in access)
    for line in handler.lines:
        assert ADMIN not in line and "key-alice" not in line, line


@pytest.mark.parametrize(("target", "logged"), [
    ("/v1/models?q=sk-bob-SECRET222&n=2", "/v1/models?q=[redacted]&n=2"),
    ("/x?a=Bearer%20abc.def", "/x?a=[redacted]"),
    ("/x?jwt=eyJhbGciOi.eyJzdWIiOi.sig", "/x?jwt=[redacted]"),
    ("/x?p=ghp_0123456789abcdef", "/x?p=[redacted]"),
    ("/api/stats?window=60&model=skate", "/api/stats?window=60&model=skate"),  # kept
    ("/v1/models", "/v1/models"),
])
def test_credential_looking_query_values_are_redacted(target: str, logged: str) -> None:
    assert access_log.redact_target(target) == logged


@pytest.mark.slow
async def test_abandoned_requests_free_the_real_engine(make_real_app, real_backend) -> None:
    app = make_real_app(max_tokens_cap=2000)
    engine = real_backend.engine
    body = {"model": "smollm2-135m-instruct", "max_tokens": 2000, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell a very long story. " * 40}]}

    def busy() -> int:
        stats = engine.stats()
        return int(stats.running + stats.waiting)

    async with asgi_client(app, timeout=120) as http:
        for _ in range(4):  # each gives up as soon as the engine holds its request
            await _abandon(app, body, lambda: busy() > 0)
        for _ in range(600):  # 2000 tokens each would take minutes: only an abort frees it
            if busy() == 0:
                break
            await asyncio.sleep(0.05)
        assert busy() == 0 and engine.stats().pages_used == 0
        fresh = await http.post("/v1/chat/completions", json={**CHAT,
                                "model": "smollm2-135m-instruct", "max_tokens": 4})
        assert fresh.status_code == 200
    assert sorted(r.status for r in records(app)) == [200, 499, 499, 499, 499]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_abort_is_not_a_finished_answer(make_real_app, real_backend,
                                                        stream) -> None:
    """A request the engine aborts on its own (as its shutdown aborts every request) is a 503
    in the caller's format (whole) or the stream's error event, recorded as such; never a 200
    whose cut text says it finished ("stop")."""
    app = make_real_app(max_tokens_cap=2000)
    engine = real_backend.engine
    body = {"model": "smollm2-135m-instruct", "max_tokens": 2000, "temperature": 0,
            "stream": stream,
            "messages": [{"role": "user", "content": "Tell a very long story. " * 4}]}

    async def abort_when_running() -> None:
        while not engine.stats().running:
            await asyncio.sleep(0.02)
        [rid] = [r for r in await _running_ids(engine)]
        assert await engine.abort(rid)

    async with asgi_client(app, timeout=120) as http:
        aborter = asyncio.ensure_future(abort_when_running())
        response = await http.post("/v1/chat/completions", json=body)
        await aborter
    if stream:
        assert response.status_code == 200
        last = [line for line in response.text.splitlines() if line.startswith("data: {")][-1]
        error = json.loads(last[6:])["error"]
        assert error["type"] and "aborted" in error["message"]
    else:
        assert "aborted" in assert_error_format(response, "openai", 503)
    [row] = records(app)
    assert row.status == 503 and "aborted" in (row.error or "")


async def _running_ids(engine: Any) -> list[str]:
    """The ids of the requests the engine runs now (read on its loop thread)."""
    return [seq.request_id for seq in engine.engine.scheduler.running]

