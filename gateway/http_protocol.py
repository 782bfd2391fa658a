"""The HTTP server protocol: uvicorn's httptools protocol, a whole response in one write.

uvicorn writes a response's head as soon as the app sends `http.response.start`, then each body
chunk as it comes: two writes for one JSON answer, and a client waiting on its socket is woken
twice. Waking a waiting process is the dear part of a write on a machine whose CPUs idle
between requests (a virtual CPU halts and is woken by the host): in front of an upstream that
answers after 20 ms, one write took 0.62-0.95 ms off the gateway's p50 (paired, one client,
bench_gateway's requests, three rounds), and nothing measurable when nothing idles.

`OneWriteProtocol` holds the head of a whole response (one that declares its length, or has
no body: 204, 304) until its first body chunk and writes both with one `writelines`; a response
without a length (a stream: chunked) has its head written at once, as before, so a stream's
headers still reach the client before its first token. A held head never waits past the message
it came with: it is written when its body chunk is, when a body message wrote nothing (a HEAD
request), or when the connection closes.

uvicorn formats an access line for every response whenever its access logger has a handler;
this protocol formats it only when the logger would emit it (at info, not above).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

Send = Callable[[Any], Awaitable[None]]


class HeldHeadTransport:
    """A connection's transport that can hold one write (a response head) until the next."""

    __slots__ = ("_armed", "_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._armed = False
        self._held: bytes | None = None

    def hold_next(self) -> None:
        """Hold the next write until the one after it (or `flush`)."""
        self._armed = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.writelines((held, data))
        elif self._armed:
            self._armed = False
            self._held = bytes(data)
        else:
            self._transport.write(data)

    def writelines(self, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(chunks))

    def flush(self) -> None:
        """Write what is held; hold nothing more."""
        self._armed = False
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._armed, self._held = False, None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose length-delimited responses go out in one write."""

    held: HeldHeadTransport

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.held = HeldHeadTransport(transport)
        super().connection_made(self.held)  # type: ignore[arg-type]
        # uvicorn formats an access line whenever its logger has a handler; one that would be
        # dropped (a level above info) is not formatted at all
        self.access_log = self.access_log and self.access_logger.isEnabledFor(logging.INFO)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and not getattr(cycle, "one_write", False):
            # the app is handed `cycle.send` when its task first runs, after this returns
            cycle.send = one_write_send(cycle.send, self.held)  # type: ignore[method-assign,assignment]
            cycle.one_write = True  # type: ignore[attr-defined]


def one_write_send(send: Send, transport: HeldHeadTransport) -> Send:
    """`send`, holding the head of a response that declares its length for its first chunk."""

    async def send_message(message: Any) -> None:
        start = message["type"] == "http.response.start"
        if start and is_whole(message):
            transport.hold_next()
        try:
            await send(message)
        finally:
            if not start:
                transport.flush()

    return send_message


def is_whole(message: Any) -> bool:
    """Whether a response start is of a whole response: one with no body (204, 304) or one
    that declares its length (`content-length`)."""
    if message.get("status") in NO_BODY:
        return True
    headers = message.get("headers") or ()
    if not isinstance(headers, list | tuple):  # an iterable is read once: keep what it gave
        message["headers"] = headers = list(headers)
    # Starlette appends the length to its headers: looked for from the end
    return any(name.lower() == b"content-length" for name, _ in reversed(headers))


NO_BODY = frozenset({204, 304})
