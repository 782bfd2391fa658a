"""The server protocol against hostile or unusual clients: oversized heads, requests answered
before their body, upgrade requests. Each case is checked against what a client must receive
(HTTP/1.1, RFC 9110/9112), and against uvicorn's own protocol where that one gets it right."""

from __future__ import annotations

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
