"""An httpx transport on asyncio's own sockets and httptools' parser: the upstream hop.

The backends speak httpx (`httpx.Request` in, `httpx.Response` out); what carries the bytes is
the transport. This one is HTTP/1.1 written for one job, a proxy's hop to an upstream it keeps
connections open to: each request is one `write` of its head and body on a pooled connection,
and the answer is parsed by httptools (the C parser uvicorn serves with) as it arrives. Measured
beside aiohttp's client under the same interface (`benchmarks/bench_gateway.py`, one client, an
instant upstream), the hop costs ~0.3 ms less per request; most of a proxy's added latency on a
small machine is the Python its requests run through, cache-cold.

- connections: at most `max_connections` open in all (a request waits up to the `pool` timeout
  for one), idle ones kept `keepalive_expiry` seconds, the most recently used first;
- timeouts from the request's `timeout` extension: `connect`, `read` (each wait for the head or
  a body chunk), `pool`; no write timeout (a write is handed to the event loop at once);
- a connection that was kept idle and closes before any byte of its answer raises
  `httpx.RemoteProtocolError` (`upstream_http.send` retries such a request once: the server
  dropped it while idle and took nothing); any other failed answer (a new connection closed
  unanswered, an answer cut or malformed after its first byte) raises `AnswerFailed`, never
  retried: the server may have taken the request, and a POST sent twice is run twice;
- TLS with certifi's store (`tls_context`), HTTP/1.1 only; bodies pass through undecoded
  (httpx decodes `content-encoding`); answers framed by length, by chunks or by the close;
- an origin the environment routes through a proxy (`HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY`,
  read once per origin) goes through `AiohttpTransport`, which speaks to proxies;
- the gateway's `REQUEST_SENT` callback, when set, is called once the request is written;
- a request's head is written by `gateway.backends.http1_request` (the backends' POSTs are
  `PreparedPost`s, their head made once per URL);
- an answer's httpx headers are made only when read: a whole answer is read from its body
  (`AnswerBody.whole`) and asked for none.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import httptools
import httpx

from gateway.backends.aiohttp_transport import (
    AiohttpTransport,
    env_proxy,
    request_bytes,
    tls_context,
)
from gateway.backends.http1_request import Origin, PreparedPost, head_of, origin_of
from gateway.types import REQUEST_SENT

HIGH_WATER = 256 << 10  # unread answer bytes past which a connection stops reading


class AnswerFailed(httpx.RemoteProtocolError):
    """An answer that failed where the server may have taken its request (see the module
    docstring): never sent again."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the answer being read from it."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle_since = 0.0
        self.requests = 0  # sent on this connection (past one: a kept connection)
        self._reset()

    def _reset(self) -> None:
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.done = False
        self.framed = False  # a content-length or chunked answer (else: ends at the close)
        self.error: str | None = None  # why the answer cannot be read
        self.heard = False  # any byte of the answer arrived
        self.keep_alive = False
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP (or TLS) transport

    def data_received(self, data: bytes) -> None:
        self.heard = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed answer ({exc})")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.status is not None and not self.done and not self.framed:
            self.done = True  # an answer without a length ends with its connection
        elif not self.done:
            self._fail("server closed the connection" if self.heard
                       else "server closed the connection without answering")
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # the request side
    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self.requests += 1
        self.transport.writelines((head, body))

    async def head(self, timeout: float | None, request: httpx.Request) -> int:
        while self.status is None:
            self._raise_error(request)
            await self._wait(timeout, request)
        return self.status

    async def chunk(self, timeout: float | None, request: httpx.Request) -> bytes | None:
        """The next piece of the answer's body; None at its end."""
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self._paused and self.buffered <= HIGH_WATER // 2 and self.transport:
                    self._paused = False
                    self.transport.resume_reading()
                return chunk
            if self.done:
                return None
            self._raise_error(request)
            await self._wait(timeout, request)

    def reusable(self) -> bool:
        return self.done and self.keep_alive and not self.lost and self.error is None

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self._wake()

    def _raise_error(self, request: httpx.Request) -> None:
        if self.error is not None:
            stale = self.requests > 1 and not self.heard  # dropped while idle: nothing taken
            kind = httpx.RemoteProtocolError if stale else AnswerFailed
            raise kind(self.error, request=request)

    async def _wait(self, timeout: float | None, request: httpx.Request) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        except TimeoutError:
            self.close()
            raise httpx.ReadTimeout("timed out waiting for the upstream", request=request) from None
        finally:
            if timer is not None:
                timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class AnswerBody(httpx.AsyncByteStream):
    """An answer's body as httpx's async byte stream; `aclose` gives the connection back."""

    def __init__(self, owner: Http1Transport, conn: _Connection, request: httpx.Request,
                 timeout: float | None) -> None:
        self._owner, self._conn, self._request, self._timeout = owner, conn, request, timeout
        self._closed = False

    async def __aiter__(self) -> Any:
        conn = self._conn
        while (chunk := await conn.chunk(self._timeout, self._request)) is not None:
            yield chunk

    def encoded(self) -> bool:
        """Whether the answer declares a content encoding (for httpx to decode)."""
        return any(name.lower() == b"content-encoding" for name, _ in self._conn.headers)

    async def whole(self) -> bytes:
        """The rest of the body, joined."""
        conn, parts = self._conn, []
        while (chunk := await conn.chunk(self._timeout, self._request)) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Back to the pool when the answer was read to its end, else the connection is
        closed (its unread rest would corrupt the next answer on it)."""
        if not self._closed:
            self._closed = True
            self._owner.release(self._conn)


class _Answer(httpx.Response):
    """httpx's response over one of our connections, its headers made when first read (a
    whole answer is read from its stream, `AnswerBody.whole`, and asked for no header)."""

    def __init__(self, status: int, raw: list[tuple[bytes, bytes]], stream: AnswerBody,
                 request: httpx.Request) -> None:
        super().__init__(status, stream=stream, request=request,
                         extensions={"http_version": b"HTTP/1.1"})
        self._raw = raw
        self._made: httpx.Headers | None = None  # httpx set empty ones: made on demand instead

    @property
    def headers(self) -> httpx.Headers:
        made = self._made
        if made is None:
            made = self._made = httpx.Headers(self._raw)
        return made

    @headers.setter
    def headers(self, value: httpx.Headers) -> None:
        self._made = value


class Http1Transport(httpx.AsyncBaseTransport):
    """httpx's transport interface over pooled HTTP/1.1 connections (module docstring)."""

    def __init__(self, limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits()
        self._limit = limits.max_connections or 1 << 30
        self._expiry = limits.keepalive_expiry if limits.keepalive_expiry is not None else 5.0
        self.tls = tls_context()
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._via: dict[Origin, bool] = {}  # origin -> reached through a proxy
        self._via_proxy: AiohttpTransport | None = None
        self._limits = limits
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send `request`; the answer's body streams from the connection."""
        prepared = request if isinstance(request, PreparedPost) else None
        origin = prepared.template.origin if prepared is not None else origin_of(request.url)
        if self._proxied(origin, request.url):
            return await self._proxy_transport().handle_async_request(request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout") or {}
        body = prepared.content if prepared is not None else await request_bytes(request)
        conn = await self._acquire(origin, timeouts, request)
        try:
            conn.send(prepared.head() if prepared is not None else head_of(request, len(body)),
                      body)
            sent = REQUEST_SENT.get()
            if sent is not None:
                sent()
            status = await conn.head(timeouts.get("read"), request)
        except BaseException:
            conn.close()
            self.release(conn)
            raise
        return _Answer(status, conn.headers,
                       AnswerBody(self, conn, request, timeouts.get("read")), request)

    def release(self, conn: _Connection) -> None:
        """Keep `conn` for the next request to its origin, or close it; wake one waiter."""
        if conn.reusable() and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.origin, []).append(conn)
        else:
            conn.close()
            self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _acquire(self, origin: Origin, timeouts: dict[str, float | None],
                       request: httpx.Request) -> _Connection:
        """A kept connection to `origin` (newest first), else a new one within the limit,
        else the first one given back (waiting up to the `pool` timeout)."""
        deadline = _deadline(timeouts.get("pool"))
        while True:
            idle = self._idle.get(origin)
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if not conn.lost and now - conn.idle_since < self._expiry:
                    return conn
                conn.close()
                self._open -= 1
            if self._open < self._limit:
                self._open += 1
                try:
                    return await self._connect(origin, timeouts.get("connect"), request)
                except BaseException:
                    self._open -= 1
                    raise
            await self._wait_for_release(deadline, request)

    async def _wait_for_release(self, deadline: float | None, request: httpx.Request) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(waiter, left)
        except TimeoutError:
            raise httpx.PoolTimeout("no upstream connection free in time",
                                    request=request) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken, then cancelled: the wake-up goes to the next one
            raise

    async def _connect(self, origin: Origin, timeout: float | None,
                       request: httpx.Request) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self.tls if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(origin), origin.host, origin.port, ssl=tls,
                    server_hostname=origin.host if tls else None)
        except TimeoutError:
            raise httpx.ConnectTimeout("timed out connecting to the upstream",
                                       request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
        return conn

    def _proxied(self, origin: Origin, url: httpx.URL) -> bool:
        """Whether the environment routes `url`'s origin through a proxy (read once)."""
        found = self._via.get(origin)
        if found is None:
            found = self._via[origin] = env_proxy(url).url is not None
        return found

    def _proxy_transport(self) -> AiohttpTransport:
        if self._via_proxy is None:
            self._via_proxy = AiohttpTransport(self._limits)
        return self._via_proxy

    async def aclose(self) -> None:
        """Close every kept connection (and the proxy transport, if one was used)."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        if self._via_proxy is not None:
            await self._via_proxy.aclose()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout
