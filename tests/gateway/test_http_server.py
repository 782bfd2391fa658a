"""The server protocol: the bytes uvicorn's own protocol sends, in fewer writes.

Each case runs one ASGI app under `HttpProtocol` and under uvicorn's `HttpToolsProtocol` (the
reference) over a transport that records every write, pause and close: the bytes a client
receives are identical, the app sees the same scope and messages, a response with a length
goes out in one write, and a stream's head still goes out before its first chunk."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway import http_exchange
from gateway.http_server import HttpProtocol

Protocol = type[HttpToolsProtocol] | type[HttpProtocol]
BOTH = pytest.mark.parametrize("protocol", [HttpToolsProtocol, HttpProtocol],
                               ids=["uvicorn", "ours"])
RELEASE = asyncio.Event()  # a new one for each test (an event belongs to one loop)
SEEN: list[Any] = []  # what the apps saw, in order


async def stream(request: Request) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"first "
        await RELEASE.wait()  # the client has the head and first chunk before this is let go
        yield b"second"

    return StreamingResponse(chunks(), media_type="text/plain")


async def broken(request: Request) -> Response:
    class Half(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"10")]})
            raise RuntimeError("the app failed after its head")

    return Half()


async def echo(request: Request) -> Response:
    """The body back, with its length; what the scope said, in the record."""
    scope = request.scope
    SEEN.append({k: scope[k] for k in ("method", "path", "raw_path", "query_string",
                                       "root_path", "http_version", "scheme", "headers",
                                       "client", "server")})
    try:
        body = await request.body()
    except ClientDisconnect:
        SEEN.append("disconnected")
        raise
    return PlainTextResponse(b"%d:%s" % (len(body), body[:40]))


async def hold(request: Request) -> Response:
    """Reads the body, then waits for the client to go (its disconnect is recorded)."""
    await request.body()
    message = await request.receive()
    SEEN.append(message["type"])
    return Response(status_code=204)


async def fail(request: Request) -> Response:
    raise ValueError("the app failed before its head")


async def bad_header(request: Request) -> Response:
    return Response(b"x", headers={"x-evil": "a\r\nset-cookie: b"})


APP = Starlette(routes=[
    Route("/json", lambda r: JSONResponse({"answer": "x" * 3000}), methods=["GET", "HEAD"]),
    Route("/empty", lambda r: Response(status_code=204)),
    Route("/stream", stream),
    Route("/broken", broken),
    Route("/echo", echo, methods=["GET", "POST"]),
    Route("/hold", hold, methods=["POST"]),
    Route("/fail", fail),
    Route("/bad-header", bad_header),
])


async def silent(scope: Any, receive: Any, send: Any) -> None:
    """An app that returns without answering."""
    if scope["type"] == "http":
        await receive()


class RecordingTransport(asyncio.Transport):
    """Records each write call ("write" | "writelines", the bytes), pauses and the close."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closed = False
        self.reading = True
        self.pauses = 0

    def write(self, data: Any) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, chunks: Any) -> None:
        self.calls.append(("writelines", b"".join(bytes(c) for c in chunks)))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name,
                                                                                        default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        self.reading = True

    def received(self) -> bytes:
        return b"".join(data for _, data in self.calls)


def connect(protocol_class: Protocol, app: Any = APP,
            configured: Callable[[], None] | None = None, **options: Any
            ) -> tuple[Any, RecordingTransport, ServerState]:
    """A fresh connection; `configured` is called once uvicorn has set its loggers up."""
    config = Config(app=app, http=protocol_class, date_header=False, server_header=False,
                    log_level="critical", lifespan="off", **options)
    config.load()
    if configured is not None:
        configured()
    state = ServerState()
    protocol = protocol_class(config=config, server_state=state, app_state={},
                              _loop=asyncio.get_running_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport, state


async def until(transport: RecordingTransport, done: Callable[[bytes], bool]) -> bytes:
    for _ in range(400):
        if transport.closed or done(transport.received()):
            break
        await asyncio.sleep(0.005)
    return transport.received()


def answers(n: int, end: bytes = b"") -> Callable[[bytes], bool]:
    return lambda got: got.count(b"HTTP/1.1 ") >= n and got.endswith(end)


async def serve_once(protocol_class: Protocol, request: bytes | list[bytes], end: bytes,
                     responses: int = 1, configured: Callable[[], None] | None = None,
                     app: Any = APP, **options: Any) -> RecordingTransport:
    """`request` (or its segments, fed one by one) through a fresh connection; returns once
    `end` ends what was written after `responses` response heads (or the transport
    closed)."""
    protocol, transport, _ = connect(protocol_class, app, configured, **options)
    for segment in [request] if isinstance(request, bytes) else request:
        protocol.data_received(segment)
        await asyncio.sleep(0.01)
    await until(transport, answers(responses, end))
    protocol.connection_lost(None)
    return transport


async def same_bytes(request: bytes | list[bytes], end: bytes, responses: int = 1,
                     **options: Any) -> tuple[RecordingTransport, RecordingTransport]:
    """(reference, ours) for one request, after checking that their bytes are equal."""
    SEEN.clear()
    reference = await serve_once(HttpToolsProtocol, request, end, responses, **options)
    seen = list(SEEN)
    SEEN.clear()
    ours = await serve_once(HttpProtocol, request, end, responses, **options)
    assert ours.received() == reference.received()
    assert seen == SEEN
    assert ours.closed == reference.closed
    return reference, ours


GET = b"GET %s HTTP/1.1\r\nhost: gw\r\n\r\n"


@pytest.fixture(autouse=True)
def release() -> None:
    global RELEASE
    RELEASE = asyncio.Event()


def post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    head = b"".join(h + b"\r\n" for h in extra)
    return b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n%s\r\n%s" % (
        path, len(body), head, body)


@pytest.mark.parametrize(("request_bytes", "end"), [
    (GET % b"/json", b"x\"}"),
    (b"HEAD /json HTTP/1.1\r\nhost: gw\r\n\r\n", b"\r\n\r\n"),
    (GET % b"/empty", b"\r\n\r\n"),
])
async def test_a_response_with_a_length_is_one_write_of_the_same_bytes(
        request_bytes: bytes, end: bytes) -> None:
    reference, ours = await same_bytes(request_bytes, end)
    assert reference.received().startswith(b"HTTP/1.1 2")
    assert len(reference.calls) >= 1 and len(ours.calls) == 1


async def test_a_streams_head_goes_out_before_its_first_chunk() -> None:
    RELEASE.clear()
    ours_task = asyncio.ensure_future(serve_once(HttpProtocol, GET % b"/stream", b"0\r\n\r\n"))
    await asyncio.sleep(0.1)  # the stream waits on RELEASE: its head and first chunk are out
    RELEASE.set()
    ours = await ours_task
    RELEASE.clear()
    reference_task = asyncio.ensure_future(
        serve_once(HttpToolsProtocol, GET % b"/stream", b"0\r\n\r\n"))
    await asyncio.sleep(0.1)
    RELEASE.set()
    reference = await reference_task
    assert ours.received() == reference.received()
    assert ours.calls[0][1].startswith(b"HTTP/1.1 200") and ours.calls[0][1].endswith(b"\r\n\r\n")
    assert b"first" in ours.calls[1][1] and b"second" not in ours.calls[1][1]


async def test_a_held_head_is_written_before_the_connection_closes() -> None:
    reference, ours = await same_bytes(GET % b"/broken", b"never")
    assert reference.closed and ours.closed
    assert ours.received().startswith(b"HTTP/1.1 200") and ours.received().endswith(b"\r\n\r\n")


async def test_pipelined_requests_each_get_one_write() -> None:
    two = GET % b"/json" + post(b"/echo", b"second body")
    reference, ours = await same_bytes(two, b"11:second body", responses=2)
    assert reference.received().count(b"HTTP/1.1 200") == 2
    assert [kind for kind, _ in ours.calls] == ["writelines", "writelines"]


async def test_keep_alive_serves_requests_one_after_another() -> None:
    segments = [post(b"/echo", b"one"), GET % b"/json", post(b"/echo", b"three")]
    _, ours = await same_bytes(segments, b"5:three", responses=3)
    assert [data.startswith(b"HTTP/1.1 200") for _, data in ours.calls] == [True] * 3


async def test_a_body_in_pieces_and_the_scope_are_what_uvicorn_gives() -> None:
    body = b"abcdefghij" * 30
    whole = post(b"/echo?x=1&y=%20z", body, b"x-Trailing:  spaced \t", b"X-Two: 2")
    reference, _ = await same_bytes([whole[:30], whole[30:100], whole[100:250], whole[250:]],
                                    b"abcdef")
    assert reference.received().endswith(b"\r\n\r\n300:" + body[:40])
    # percent-escapes decoded in path, kept in raw_path; a root path before both
    await same_bytes(GET % b"/echo/%2e%2E/echo", b"\r\n\r\n")
    await same_bytes(GET % b"/echo", b"0:", root_path="/gw")


async def test_expect_100_continue_is_answered_when_the_app_reads() -> None:
    request = post(b"/echo", b"payload", b"expect: 100-Continue")
    head, body = request.split(b"\r\n\r\n", 1)
    reference, ours = await same_bytes([head + b"\r\n\r\n", body], b"7:payload")
    assert ours.received().startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200")


async def test_a_large_body_pauses_reading_until_the_app_takes_it() -> None:
    body = b"z" * (200 << 10)
    request = post(b"/echo", body)
    pieces = [request[:150 << 10], request[150 << 10:]]  # 150 KiB arrive before the app reads
    reference, ours = await same_bytes(pieces, b"z" * 40)
    assert reference.pauses >= 1 and reference.reading
    assert ours.received().split(b"\r\n\r\n", 1)[1].startswith(b"%d:" % len(body))
    assert ours.pauses >= 1 and ours.reading


async def test_a_client_gone_mid_body_is_a_disconnect_to_the_app() -> None:
    for protocol_class in (HttpToolsProtocol, HttpProtocol):
        SEEN.clear()
        protocol, transport, _ = connect(protocol_class)
        protocol.data_received(post(b"/echo", b"x" * 1000)[:-500])
        await asyncio.sleep(0.02)
        protocol.connection_lost(None)
        await asyncio.sleep(0.02)
        assert SEEN[-1] == "disconnected", protocol_class
        assert transport.received() == b""


async def test_a_client_gone_after_its_body_is_heard_by_a_waiting_app() -> None:
    for protocol_class in (HttpToolsProtocol, HttpProtocol):
        SEEN.clear()
        protocol, transport, _ = connect(protocol_class)
        protocol.data_received(post(b"/hold", b"body"))
        await asyncio.sleep(0.02)
        assert SEEN == []  # the app waits
        protocol.connection_lost(None)
        await asyncio.sleep(0.02)
        assert SEEN == ["http.disconnect"], protocol_class


@pytest.mark.parametrize("request_bytes", [
    b"GET /json HTTP/1.0\r\nhost: gw\r\n\r\n",
    b"GET /json HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n",
])
async def test_a_connection_asked_to_close_is_closed_after_its_answer(
        request_bytes: bytes) -> None:
    _, ours = await same_bytes(request_bytes, b"x\"}")
    assert ours.closed and b"connection: close" in ours.received()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GARBAGE\r\n\r\n", b"400"),
    (b"GET /json HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n", b"400"),
    (GET % b"/fail", b"500"),
    (GET % b"/bad-header", None),  # an injected header line is never written
])
async def test_bad_requests_and_failing_apps_are_answered_as_uvicorn_does(
        request_bytes: bytes, status: bytes | None) -> None:
    reference, ours = await same_bytes(request_bytes, b"never")
    assert ours.closed
    if status is None:
        assert ours.received() == b""
    else:
        assert ours.received().startswith(b"HTTP/1.1 " + status)


@BOTH
async def test_an_app_that_never_answers_gets_a_500(protocol: Protocol) -> None:
    transport = await serve_once(protocol, GET % b"/", b"Error", app=silent)
    assert transport.received().startswith(b"HTTP/1.1 500 Internal Server Error")


@BOTH
async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(
        protocol: Protocol) -> None:
    server, transport, _ = connect(protocol, timeout_keep_alive=0.15)
    server.data_received(GET % b"/json")
    await asyncio.sleep(0.1)
    server.data_received(GET % b"/json")  # busy again before the timeout: kept open
    await asyncio.sleep(0.1)
    assert not transport.closed and transport.received().count(b"HTTP/1.1 200") == 2
    await asyncio.sleep(0.25)
    assert transport.closed


async def test_a_connection_without_a_whole_head_is_closed_after_the_timeout() -> None:
    silent_one, silent_transport, _ = connect(HttpProtocol, timeout_keep_alive=0.15)
    trickling, trickling_transport, _ = connect(HttpProtocol, timeout_keep_alive=0.15)
    trickling.data_received(b"GET /json HTTP/1.1\r\n")
    for _ in range(12):  # a header byte now and then never completes the head
        await asyncio.sleep(0.05)
        trickling.data_received(b"x")
    assert silent_transport.closed and trickling_transport.closed
    assert silent_transport.received() == trickling_transport.received() == b""


async def test_a_request_served_past_the_timeout_keeps_its_connection() -> None:
    RELEASE.clear()
    server, transport, _ = connect(HttpProtocol, timeout_keep_alive=0.1)
    server.data_received(GET % b"/stream")
    await asyncio.sleep(0.1)
    server.data_received(b"GET /json HTTP/1.1\r\n")  # the next one's head, begun meanwhile
    await asyncio.sleep(0.3)
    assert not transport.closed
    RELEASE.set()
    server.data_received(b"host: gw\r\n\r\n")
    got = await until(transport, answers(2, b'x"}'))
    assert got.endswith(b'x"}') and not transport.closed


@BOTH
async def test_shutdown_closes_once_the_request_in_flight_is_answered(
        protocol: Protocol) -> None:
    idle, idle_transport, _ = connect(protocol)
    idle.shutdown()
    assert idle_transport.closed
    busy, transport, _ = connect(protocol)
    busy.data_received(post(b"/hold", b"body"))
    await asyncio.sleep(0.02)
    busy.shutdown()
    assert not transport.closed
    busy.connection_lost(None)  # the client goes; the app answers nobody
    await asyncio.sleep(0.02)
    assert SEEN[-1] == "http.disconnect"


@BOTH
async def test_a_full_socket_buffer_holds_the_next_write(protocol: Protocol) -> None:
    RELEASE.clear()
    server, transport, _ = connect(protocol)
    server.data_received(GET % b"/stream")
    await asyncio.sleep(0.02)
    server.pause_writing()
    RELEASE.set()
    await asyncio.sleep(0.05)
    assert b"second" not in transport.received()
    server.resume_writing()
    got = await until(transport, lambda got: got.endswith(b"0\r\n\r\n"))
    assert b"second" in got


@BOTH
async def test_past_the_concurrency_limit_a_request_gets_a_503(protocol: Protocol) -> None:
    transport = await serve_once(protocol, GET % b"/json", b"Unavailable", limit_concurrency=1)
    assert transport.received().startswith(b"HTTP/1.1 503")


@pytest.mark.parametrize(("level", "formatted"), [(logging.INFO, True), (logging.WARNING, False)])
async def test_an_access_line_is_formatted_only_when_it_would_be_logged(
        level: int, formatted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn formats its access line whenever its logger has a handler; ours only when the
    line would be emitted (at info), and then it is, as uvicorn's is."""
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("uvicorn.access")
    handler = Lines()

    def configured() -> None:  # uvicorn's set-up sets the level and handlers: then ours
        monkeypatch.setattr(logger, "level", level)
        logger.addHandler(handler)

    asked: list[object] = []
    monkeypatch.setattr(http_exchange, "client_field",
                        lambda scope: asked.append(scope) or "127.0.0.1:50000")
    try:
        ours = await serve_once(HttpProtocol, GET % b"/json", b"x\"}", configured=configured)
    finally:
        logger.removeHandler(handler)
    assert ours.received().startswith(b"HTTP/1.1 200")
    assert bool(asked) is formatted
    assert [line for line in lines if "GET /json" in line] == (
        ['127.0.0.1:50000 - "GET /json HTTP/1.1" 200'] if formatted else [])
