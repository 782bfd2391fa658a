"""The server protocol: a whole response in one write, byte for byte what uvicorn's own sends.

Each case runs a Starlette app under `OneWriteProtocol` and under uvicorn's `HttpToolsProtocol`
(the reference) over a transport that records every write: the bytes a client receives are
identical, a response with a length goes out in one write, and a stream's head still goes out
before its first chunk."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.config import Config
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.http_protocol import OneWriteProtocol

RELEASE = asyncio.Event()


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


APP = Starlette(routes=[
    Route("/json", lambda r: JSONResponse({"answer": "x" * 3000}), methods=["GET", "HEAD"]),
    Route("/empty", lambda r: Response(status_code=204)),
    Route("/stream", stream),
    Route("/broken", broken),
])


class RecordingTransport(asyncio.Transport):
    """Records each write call: ("write" | "writelines", the bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closed = False

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
        pass

    def resume_reading(self) -> None:
        pass

    def received(self) -> bytes:
        return b"".join(data for _, data in self.calls)


async def serve_once(protocol_class: type[HttpToolsProtocol], request: bytes,
                     until: bytes, responses: int = 1,
                     configured: Callable[[], None] | None = None) -> RecordingTransport:
    """`request` through a fresh connection; returns once `until` ends what was written after
    `responses` response heads (or the transport closed). `configured` is called once uvicorn
    has set its loggers up."""
    config = Config(app=APP, http=protocol_class, date_header=False, server_header=False,
                    log_level="critical", lifespan="off")
    config.load()
    if configured is not None:
        configured()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    for _ in range(400):
        got = transport.received()
        if transport.closed or (got.endswith(until) and got.count(b"HTTP/1.1 ") >= responses):
            break
        await asyncio.sleep(0.005)
    protocol.connection_lost(None)
    return transport


GET = b"GET %s HTTP/1.1\r\nhost: gw\r\n\r\n"


@pytest.mark.parametrize(("request_bytes", "until"), [
    (GET % b"/json", b"x\"}"),
    (b"HEAD /json HTTP/1.1\r\nhost: gw\r\n\r\n", b"\r\n\r\n"),
    (GET % b"/empty", b"\r\n\r\n"),
])
async def test_a_response_with_a_length_is_one_write_of_the_same_bytes(
        request_bytes: bytes, until: bytes) -> None:
    reference = await serve_once(HttpToolsProtocol, request_bytes, until)
    ours = await serve_once(OneWriteProtocol, request_bytes, until)
    assert reference.received().startswith(b"HTTP/1.1 2")
    assert ours.received() == reference.received()
    assert len(reference.calls) >= 1 and len(ours.calls) == 1


async def test_a_streams_head_goes_out_before_its_first_chunk() -> None:
    RELEASE.clear()
    ours_task = asyncio.ensure_future(
        serve_once(OneWriteProtocol, GET % b"/stream", b"0\r\n\r\n"))
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
    reference = await serve_once(HttpToolsProtocol, GET % b"/broken", b"never")
    ours = await serve_once(OneWriteProtocol, GET % b"/broken", b"never")
    assert reference.closed and ours.closed
    assert ours.received() == reference.received()
    assert ours.received().startswith(b"HTTP/1.1 200") and ours.received().endswith(b"\r\n\r\n")


async def test_pipelined_requests_each_get_one_write() -> None:
    two = GET % b"/json" + GET % b"/json"
    reference = await serve_once(HttpToolsProtocol, two, b"x\"}", responses=2)
    ours = await serve_once(OneWriteProtocol, two, b"x\"}", responses=2)
    assert reference.received().count(b"HTTP/1.1 200") == 2
    assert ours.received() == reference.received()
    assert [kind for kind, _ in ours.calls] == ["writelines", "writelines"]


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
    monkeypatch.setattr(httptools_impl, "get_client_addr",
                        lambda scope: asked.append(scope) or "127.0.0.1:50000")
    try:
        ours = await serve_once(OneWriteProtocol, GET % b"/json", b"x\"}", configured=configured)
    finally:
        logger.removeHandler(handler)
    assert ours.received().startswith(b"HTTP/1.1 200")
    assert bool(asked) is formatted
    assert [line for line in lines if "GET /json" in line] == (
        ['127.0.0.1:50000 - "GET /json HTTP/1.1" 200'] if formatted else [])


@pytest.mark.parametrize("make", [list, tuple, iter])
def test_a_whole_response_is_told_by_its_length_wherever_it_is(make: Any) -> None:
    from gateway.http_protocol import is_whole

    for at in range(3):
        headers = [(b"content-type", b"application/json"), (b"x-a", b"1")]
        headers.insert(at, (b"Content-Length", b"2"))
        message = {"type": "http.response.start", "status": 200, "headers": make(headers)}
        assert is_whole(message)
        assert list(message["headers"]) == headers  # an iterator's headers are kept, not spent
    chunked = {"type": "http.response.start", "status": 200,
               "headers": make([(b"transfer-encoding", b"chunked")])}
    assert not is_whole(chunked)
    assert is_whole({"type": "http.response.start", "status": 204, "headers": make([])})
