"""The server protocol against hostile or unusual clients: oversized heads, requests answered
before their body, upgrade requests. Each case is checked against what a client must receive
(HTTP/1.1, RFC 9110/9112), and against uvicorn's own protocol where that one gets it right."""

from __future__ import annotations

from typing import Any

from gateway.http_server import HttpProtocol
from gateway.http_wire import MAX_HEAD_BYTES
from tests.gateway.test_http_server import GET, answers, connect, post, same_bytes, until


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
