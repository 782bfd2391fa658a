"""The server protocol against hostile or unusual clients: oversized heads, requests answered
before their body, upgrade requests. Each case is checked against what a client must receive
(HTTP/1.1, RFC 9110/9112), and against uvicorn's own protocol where that one gets it right."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway import http_exchange
from gateway.http_server import HttpProtocol
from gateway.http_wire import MAX_HEAD_BYTES
from tests.gateway import test_http_server as http_server_test
from tests.gateway.test_http_server import (
    GET,
    SEEN,
    RecordingTransport,
    answers,
    connect,
    post,
    same_bytes,
    until,
)


async def test_a_head_past_the_limit_is_refused_with_431_and_closed() -> None:
    """httptools keeps a head whole however long it is: without a bound one connection could
    send hundreds of MB of header (the event loop joining each piece) within the head timeout."""
    server, transport, _ = connect(HttpProtocol)
    server.data_received(b"GET /json HTTP/1.1\r\nhost: gw\r\nx-big: ")
    for _ in range(MAX_HEAD_BYTES // 4096 + 2):
        if transport.closed:
            break
        server.data_received(b"a" * 4096)
    got = await until(transport, answers(1))
    assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"connection: close" in got and transport.closed


async def test_a_long_url_past_the_limit_is_refused_too() -> None:
    server, transport, _ = connect(HttpProtocol)
    server.data_received(b"GET /" + b"p" * (MAX_HEAD_BYTES + 10))
    got = await until(transport, answers(1))
    assert got.startswith(b"HTTP/1.1 431 ") and transport.closed


async def test_heads_within_the_limit_are_served_as_uvicorn_serves_them() -> None:
    big = b"x-big: " + b"a" * (MAX_HEAD_BYTES - 1024)
    whole = (GET % b"/json").replace(b"\r\n\r\n", b"\r\n" + big + b"\r\n\r\n")
    pieces = [whole[i:i + 4096] for i in range(0, len(whole), 4096)]
    reference, ours = await same_bytes(pieces, b'x"}')
    assert ours.received().startswith(b"HTTP/1.1 200")
    # a large body and the next head in one read: the body is not counted as head
    two = post(b"/echo", b"z" * (MAX_HEAD_BYTES * 2)) + GET % b"/json"
    _, ours = await same_bytes([two[:-5], two[-5:]], b'x"}', responses=2)
    assert ours.received().count(b"HTTP/1.1 200") == 2


async def unread(scope: Any, receive: Any, send: Any) -> None:
    """Answers 413 from the head alone, as the gateway does for a declared length past its
    limit (or 401 for a missing key), without reading the body."""
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"no"})


async def test_an_answer_before_a_100_continue_closes_the_connection() -> None:
    """The client was never told to send its body, so it may not; uvicorn keeps the
    connection, and the client's next request is then read as the refused body (unanswered)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nexpect: 100-continue\r\n" \
           b"content-length: 40\r\n\r\n"
    server, transport, _ = connect(HttpProtocol, app=unread)
    server.data_received(head)
    got = await until(transport, answers(1, b"no"))
    assert got.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in got
    assert b"\r\nconnection: close\r\n" in got and transport.closed


async def test_an_answer_after_the_body_came_keeps_the_connection() -> None:
    request = post(b"/x", b"b" * 40, b"expect: 100-continue")
    server, transport, _ = connect(HttpProtocol, app=unread)
    server.data_received(request + request)  # the body sent anyway: nothing is misread
    got = await until(transport, answers(2, b"no"))
    assert got.count(b"HTTP/1.1 413 ") == 2 and b"connection: close" not in got
    assert not transport.closed


UPGRADE = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQ"


async def test_an_upgrade_request_is_served_as_plain_http_with_its_body() -> None:
    """`curl --http2 -d BODY http://...` asks for h2c: httptools stops at the head, and the
    app saw an empty body (the gateway answered 400 'not valid JSON' to a valid request)."""
    server, transport, _ = connect(HttpProtocol)
    server.data_received(post(b"/echo", b"the body", UPGRADE) + GET % b"/echo?next")
    got = await until(transport, answers(2, b"0:"))
    assert got.startswith(b"HTTP/1.1 200 ") and b"\r\n\r\n8:the body" in got
    assert got.count(b"HTTP/1.1 200 ") == 2 and b"101" not in got.split(b"\r\n")[0]


async def test_an_upgrade_requests_body_is_never_read_as_a_request() -> None:
    """A body arriving after an upgrade request's head was parsed as a request of its own
    (request smuggling behind a proxy that passes Upgrade through): it is the body."""
    smuggled = GET % b"/json"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled)
    for framing, body in ((b"content-length: %d" % len(smuggled), smuggled),
                          (b"transfer-encoding: chunked", chunked)):
        server, transport, _ = connect(HttpProtocol)
        head = b"POST /echo HTTP/1.1\r\nhost: gw\r\n%s\r\n%s\r\n\r\n" % (UPGRADE, framing)
        server.data_received(head)
        await asyncio.sleep(0.02)
        server.data_received(body)
        got = await until(transport, answers(1, b"host: gw\r\n"))
        assert b"\r\n\r\n%d:GET /json HTTP/1.1" % len(smuggled) in got
        assert got.count(b"HTTP/1.1 200 ") == 1 and b'"answer"' not in got


async def test_connect_is_refused() -> None:
    server, transport, _ = connect(HttpProtocol)
    server.data_received(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nhost: 127.0.0.1:22\r\n\r\n")
    got = await until(transport, answers(1))
    assert got.startswith(b"HTTP/1.1 400 ") and transport.closed


class AbortableTransport(RecordingTransport):
    def abort(self) -> None:
        self.closed = True


def stalled_connection(monkeypatch: pytest.MonkeyPatch) -> tuple[HttpProtocol, AbortableTransport]:
    monkeypatch.setattr(http_exchange, "STALL_S", 0.1)
    server, _, _ = connect(HttpProtocol)
    transport = AbortableTransport()
    server.connection_made(transport)
    return server, transport


async def test_a_body_that_stops_arriving_is_a_disconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that vanished mid-upload (no FIN, no RST) was waited for forever, holding its
    tenant's concurrency slot (with --tenant-max-concurrency N, N such uploads lock the tenant
    out for good)."""
    SEEN.clear()
    server, transport = stalled_connection(monkeypatch)
    server.data_received(post(b"/echo", b"x" * 100)[:-60])
    for _ in range(100):
        if SEEN[-1:] == ["disconnected"]:
            break
        await asyncio.sleep(0.01)
    assert SEEN[-1] == "disconnected" and transport.closed and transport.received() == b""


async def test_a_body_that_keeps_arriving_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    SEEN.clear()
    server, transport = stalled_connection(monkeypatch)
    request = post(b"/echo", b"y" * 100)
    for i in range(0, len(request), 20):  # the whole body takes longer than STALL_S
        server.data_received(request[i:i + 20])
        await asyncio.sleep(0.04)
    got = await until(transport, answers(1, b"y" * 40))
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"\r\n\r\n100:" + b"y" * 40)


async def trickled(monkeypatch: pytest.MonkeyPatch, body: bytes, step: int,
                   pause: float) -> AbortableTransport:
    """A POST whose head arrives whole and whose body `step` bytes every `pause` seconds
    (until the server closes), against a floor of 100 bytes/s after a 0.15 s grace."""
    SEEN.clear()
    server, transport = stalled_connection(monkeypatch)
    monkeypatch.setattr(http_exchange, "STALL_S", 60.0)
    monkeypatch.setattr(http_exchange, "BODY_GRACE_S", 0.15)
    monkeypatch.setattr(http_exchange, "MIN_BODY_RATE", 100.0)
    request = post(b"/echo", body)
    head = len(request) - len(body)
    server.data_received(request[:head])
    for i in range(head, len(request), step):
        if transport.closed:
            break
        server.data_received(request[i:i + step])
        await asyncio.sleep(pause)
    return transport


async def test_a_body_that_trickles_is_refused_with_408(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sending a byte a minute never stalled for 60 s, so it held the request (and
    its tenant's concurrency slot) for as long as its body lasted: days for a few KB."""
    transport = await trickled(monkeypatch, b"z" * 1000, 4, 0.08)  # 50 bytes/s
    assert transport.closed and SEEN[-1] == "disconnected"
    got = transport.received()
    assert got.startswith(b"HTTP/1.1 408 ") and b"connection: close" in got
    assert got.endswith(b"Request body arrived too slowly.")


async def test_a_slow_body_above_the_floor_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    transport = await trickled(monkeypatch, b"w" * 120, 12, 0.04)  # 300 bytes/s, for 0.4 s
    got = await until(transport, answers(1, b"w" * 40))
    assert got.startswith(b"HTTP/1.1 200 ") and not transport.closed


async def test_a_response_the_client_stops_taking_ends_the_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that keeps its socket but reads nothing held a stream (and the engine's KV
    pages under it) for as long as it liked."""
    SEEN.clear()
    server, transport = stalled_connection(monkeypatch)
    monkeypatch.setattr(http_server_test, "RELEASE", asyncio.Event())
    server.data_received(GET % b"/stream")
    await until(transport, lambda got: b"first" in got)
    server.pause_writing()  # the socket's buffer is full and stays full
    http_server_test.RELEASE.set()
    await until(transport, lambda got: False)
    assert transport.closed and b"second" not in transport.received()


async def headers_after_body(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body, then answers with the header names its scope holds."""
    message = {"more_body": True}
    while message.get("more_body"):
        message = await receive()
    names = b",".join(name for name, _ in scope["headers"])
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"%d" % len(names))]})
    await send({"type": "http.response.body", "body": names})


async def test_a_trailer_never_becomes_a_request_header() -> None:
    """httptools reports a chunked body's trailer fields as headers; they were appended to the
    running request's header list, after a proxy in front had vetted its headers (RFC 9110
    6.5.2: a trailer is not merged into the header section)."""
    server, transport, _ = connect(HttpProtocol, app=headers_after_body)
    server.data_received(b"POST /x HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"3\r\nabc\r\n0\r\nauthorization: Bearer smuggled\r\n\r\n" + GET % b"/")
    got = await until(transport, answers(2, b"host"))
    assert got.count(b"HTTP/1.1 200 ") == 2
    assert b"\r\n\r\nhost,transfer-encoding" in got and b"authorization" not in got
