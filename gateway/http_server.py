"""The HTTP/1.1 server protocol: httptools' parser speaking ASGI, the least Python per request.

uvicorn serves the gateway (its server, lifespan, signals and reload stay); this is the
protocol it runs on each connection, in place of uvicorn's own httptools protocol, and sends
the same bytes. What it does with less: one object per request (`Exchange`, slotted, in
gateway.http_exchange) and no `asyncio.Event`; the request body kept as the parser's chunks,
joined once; a response's headers checked with two searches in all, not two per header; the
keep-alive timer armed once per idle spell, not once per request; and the head of a whole
response (one that declares its length, or has no body) written together with its first body
chunk, in one write: a client waiting on its socket is woken once (in front of an upstream that
answers after 20 ms, one write took 0.62-0.95 ms off the gateway's p50). A stream's head goes
out at once.

HTTP/1.1 as uvicorn serves it: keep-alive (closed after `timeout_keep_alive` idle seconds;
where uvicorn waits forever, a connection that sends no whole request head within that time of
connecting, or of its head's first byte, is closed too, so idle or trickling sockets cannot
pile up until the process runs out of file descriptors; a head past `MAX_HEAD_BYTES` is a 431
that closes the connection, where uvicorn reads one of any length), pipelined requests answered
in order, `Expect: 100-continue` (an answer sent before the body was asked for closes the
connection: uvicorn would read the client's next request as that body), reading paused while a
body past 64 KiB waits for the app and writing awaited while the socket's buffer is full, a
client gone mid-request heard by the app as `http.disconnect` (so is one that sends none of an
awaited body, or takes none of the response, for `STALL_S` seconds: uvicorn waits forever),
`limit_concurrency`'s 503, a 400 for a request the parser refuses, a 500 for an app that fails
before its head. No WebSocket: an upgrade request (h2c, WebSocket) is served as plain HTTP, its
body read as a body (the gateway has no WebSocket route; uvicorn's protocol gives the app an
empty body and parses a body that arrives later as a request of its own); CONNECT is a 400. A
chunked body's trailer fields are dropped (uvicorn's protocol appends them to the request's
headers while the app runs).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import urllib.parse
from collections import deque
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn import Config

from gateway.http_exchange import ACCESS_LOG, ERROR_LOG, Exchange
from gateway.http_wire import (
    MAX_HEAD_BYTES,
    READ_HIGH_WATER,
    is_tls,
    local_address,
    peer_address,
    plain_head,
    refusal,
    service_unavailable,
)

if TYPE_CHECKING:
    from uvicorn.server import ServerState




class HttpProtocol(asyncio.Protocol):
    """One client connection: requests parsed by httptools, each served by the ASGI app in a
    task of its own, one at a time (pipelined ones wait their turn)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.root_path = config.root_path
        self.asgi_version = config.asgi_version
        self.keep_alive_s = config.timeout_keep_alive
        self.limit_concurrency = config.limit_concurrency
        self.fresh_context = bool(getattr(config, "reset_contextvars", False))
        self.server_state = server_state
        self.app_state = app_state
        # an access line is formatted only when it would be emitted
        self.access_log = ACCESS_LOG.hasHandlers() and ACCESS_LOG.isEnabledFor(logging.INFO)
        self.parser = self._new_parser()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.exchange: Exchange | None = None  # the request parsed last
        self.running: Exchange | None = None  # the request being served (or served last)
        self.waiting: deque[tuple[Exchange, Any]] = deque()  # pipelined, in arrival order
        self.read_paused = False
        self.writable: asyncio.Future[None] | None = None  # set while writing is paused
        self.idle_since: float | None = None  # since when no request is in hand; None busy
        self.idle_timer: asyncio.TimerHandle | None = None
        # the request whose head is being parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_continue = False
        self.upgrade: tuple[bytes, str] | None = None  # an upgrade request's method, version
        self.in_head = True  # the bytes arriving are a request head (or what comes first)
        self.head_bytes = 0  # of the head, counted from the first read that holds only it
        self.head_began = False  # a head began during this read, after another message

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)  # type: ignore[arg-type]
        self.server = local_address(self.transport)
        self.client = peer_address(self.transport)
        self.scheme = "https" if is_tls(self.transport) else "http"
        self._go_idle()  # a connection that never sends a whole head is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        for exchange in (self.running, self.exchange):
            if exchange is not None:
                exchange.hang_up()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if exc is None:
            self.transport.close()
        self.parser = None  # type: ignore[assignment]

    def eof_received(self) -> None:
        return None  # the transport closes itself

    def data_received(self, data: bytes) -> None:
        self.head_began = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._parse_plain(data[exc.args[0]:] if exc.args else b"")
            return
        except httptools.HttpParserError:
            ERROR_LOG.warning("Invalid HTTP request received.")
            self.refuse("Invalid HTTP request received.")
            return
        if self.in_head and not self.head_began:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                ERROR_LOG.warning("Request head larger than %d bytes.", MAX_HEAD_BYTES)
                self.refuse(f"Request line and headers exceed {MAX_HEAD_BYTES} bytes.", 431)

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    # uvicorn's server

    def shutdown(self) -> None:
        """Close once the request in flight (if any) is answered."""
        exchange = self.exchange
        if exchange is None or exchange.complete:
            self.transport.close()
        else:
            exchange.keep_alive = False

    # httptools' callbacks

    def on_message_begin(self) -> None:
        if self.idle_since is not None:  # a new head has the whole timeout from its first byte
            self.idle_since = self.loop.time()
        self.url = b""
        self.headers = []
        self.expect_continue = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:  # a chunked body's trailer: never one of the request's headers
            return
        name = name.lower()
        value = value.rstrip(b" \t")  # the parser keeps trailing whitespace; a value has none
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.idle_since = None  # busy: a request to serve
        self.in_head, self.head_bytes = False, 0
        parser = self.parser
        version = parser.get_http_version()
        if parser.should_upgrade():  # parsed again without its Upgrade header: _parse_plain
            self.upgrade = parser.get_method(), version
            return
        exchange = Exchange(self, self._scope(parser.get_method().decode("ascii"), version),
                            keep_alive=version != "1.0" and parser.should_keep_alive(),
                            expect_continue=self.expect_continue)
        app = self.app
        if self.limit_concurrency is not None and (
                len(self.server_state.connections) >= self.limit_concurrency
                or len(self.server_state.tasks) >= self.limit_concurrency):
            ERROR_LOG.warning("Exceeded concurrency limit.")
            app = service_unavailable
        previous, self.exchange = self.exchange, exchange
        if previous is None or previous.complete:
            self._run(exchange, app)
        else:  # pipelined: answered once the one before is
            self.pause_reading()
            self.waiting.append((exchange, app))

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        exchange.body.append(body)
        exchange.body_size += len(body)
        exchange.received += len(body)
        if exchange.body_size > READ_HIGH_WATER:
            self.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        self.in_head = self.head_began = True  # what follows is the next head
        exchange = self.exchange
        if exchange is None or exchange.complete or self.upgrade is not None:
            return
        exchange.more_body = False
        exchange.wake()

    # the connection's own

    def _new_parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
        return parser

    def _parse_plain(self, rest: bytes) -> None:
        """An upgrade request parsed again, by a fresh parser, without its `Upgrade` header,
        and served as plain HTTP: httptools stops at an upgrade request's head, so its body
        would reach the app empty (`curl --http2 -d ...` asks for h2c) and what followed would
        be read as a request of its own. CONNECT (an upgrade by its method) is refused."""
        upgrade, self.upgrade = self.upgrade, None
        if upgrade is None or upgrade[0] == b"CONNECT":
            ERROR_LOG.warning("Unsupported upgrade request.")
            self.refuse("Unsupported upgrade request.")
            return
        self.parser = self._new_parser()
        self.data_received(plain_head(*upgrade, self.url, self.headers) + rest)

    def _scope(self, method: str, version: str) -> dict[str, Any]:
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.root_path
        return {
            "type": "http", "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": version, "server": self.server, "client": self.client,
            "scheme": self.scheme, "method": method, "root_path": root,
            "path": root + path if root else path,
            "raw_path": root.encode("ascii") + raw_path if root else raw_path,
            "query_string": url.query or b"", "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def _run(self, exchange: Exchange, app: Any) -> None:
        self.running = exchange
        context = contextvars.Context() if self.fresh_context else None
        task = self.loop.create_task(exchange.run(app), context=context)
        tasks = self.server_state.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def answered(self) -> None:
        """The response in flight is complete: the next pipelined request, or idle."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.resume_reading()
        if self.waiting:
            exchange, app = self.waiting.popleft()
            self._run(exchange, app)
            return
        self._go_idle()

    def _go_idle(self) -> None:
        """No request in hand: the connection is closed unless a whole request head arrives
        within `timeout_keep_alive` seconds (of now, or of that head's first byte)."""
        self.idle_since = self.loop.time()
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_check)

    def _idle_check(self) -> None:
        """Close a connection idle for `timeout_keep_alive` seconds; re-armed for the rest of
        the spell when it was busy since."""
        self.idle_timer = None
        if self.idle_since is None or self.transport.is_closing():
            return  # busy: armed again when its response completes
        left = self.idle_since + self.keep_alive_s - self.loop.time()
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._idle_check)
        else:
            self.transport.close()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def refuse(self, message: str, status: int = 400) -> None:
        """An error for a request refused before the app (400: the parser refused it); the
        connection is closed."""
        self.transport.write(refusal(status, message, self.server_state.default_headers))
        self.transport.close()
