"""The HTTP/1.1 server protocol: httptools' parser speaking ASGI, the least Python per request.

uvicorn serves the gateway (its server, lifespan, signals and reload stay); this is the
protocol it runs on each connection, in place of uvicorn's own httptools protocol, and sends
the same bytes. What it does with less: one object per request (`Exchange`, slotted) and no
`asyncio.Event`; the request body kept as the parser's chunks, joined once; a response's
headers checked with two searches in all, not two per header; the keep-alive timer armed once
per idle spell, not once per request; and the head of a whole response (one that declares its
length, or has no body) written together with its first body chunk, in one write: a client
waiting on its socket is woken once (in front of an upstream that answers after 20 ms, one
write took 0.62-0.95 ms off the gateway's p50). A stream's head goes out at once.

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
empty body and parses a body that arrives later as a request of its own); CONNECT is a 400.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import urllib.parse
from collections import deque
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn import Config

from gateway.http_wire import (
    MAX_HEAD_BYTES,
    READ_HIGH_WATER,
    STATUS_LINE,
    client_field,
    is_tls,
    local_address,
    peer_address,
    plain_head,
    refusal,
    service_unavailable,
    target_field,
)

if TYPE_CHECKING:
    from uvicorn.server import ServerState

NO_BODY = frozenset({204, 304})
_BAD_NAME = re.compile(rb'[\x00-\x1f\x7f()<>@,;:\[\]={} \t\\"]')  # not a token character
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # a control character other than tab
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# a client whose request body, awaited by the app, or whose reading of the response makes no
# progress for this many seconds is taken as gone (a vanished peer is otherwise never noticed)
STALL_S = 60.0
_ERROR_LOG = logging.getLogger("uvicorn.error")
_ACCESS_LOG = logging.getLogger("uvicorn.access")



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
        self.access_log = _ACCESS_LOG.hasHandlers() and _ACCESS_LOG.isEnabledFor(logging.INFO)
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
            _ERROR_LOG.warning("Invalid HTTP request received.")
            self.refuse("Invalid HTTP request received.")
            return
        if self.in_head and not self.head_began:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                _ERROR_LOG.warning("Request head larger than %d bytes.", MAX_HEAD_BYTES)
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
            _ERROR_LOG.warning("Exceeded concurrency limit.")
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
            _ERROR_LOG.warning("Unsupported upgrade request.")
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


class Exchange:
    """One request and its response: the ASGI `receive` and `send` of one app call."""

    __slots__ = ("body", "body_size", "chunked", "complete", "conn", "delivered", "disconnected",
                 "held", "keep_alive", "left", "more_body", "scope", "started", "waiter",
                 "want_continue")

    def __init__(self, conn: HttpProtocol, scope: dict[str, Any], *, keep_alive: bool,
                 expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.want_continue = expect_continue
        self.body: list[bytes] = []
        self.body_size = 0
        self.more_body = True
        self.delivered = False  # the whole body has been received by the app
        self.disconnected = False
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.complete = False
        self.chunked = False
        self.left = 0  # bytes of a declared length not yet sent
        self.held: bytes | None = None  # a whole response's head, written with its body

    def hang_up(self) -> None:
        """The client is gone: the app hears `http.disconnect` (unless it had its answer)."""
        if not self.complete:
            self.disconnected = True
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def run(self, app: Any) -> None:
        """The app's call, and what uvicorn does when it misbehaves."""
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            _ERROR_LOG.error("Exception in ASGI application\n", exc_info=exc)
            if not self.started:
                await self._send_500()
            else:
                self._close()
        else:
            if result is not None:
                _ERROR_LOG.error("ASGI callable should return None, but returned '%s'.", result)
                self._close()
            elif not self.started and not self.disconnected:
                _ERROR_LOG.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.complete and not self.disconnected:
                _ERROR_LOG.error("ASGI callable returned without completing response.")
                self._close()

    def _stalled(self) -> None:
        """No byte of the awaited body, or none of the response taken, for `STALL_S` seconds:
        the connection closes and the app hears `http.disconnect` (held forever, it would keep
        its tenant's concurrency slot, and a stream its KV pages)."""
        _ERROR_LOG.warning("Client made no progress for %.0f s; closing the connection.",
                           STALL_S)
        self.hang_up()
        self.conn.transport.abort()  # a close would wait for the unread response to drain

    def _close(self) -> None:
        """Close the connection (a held head written first, as uvicorn had written it)."""
        self._flush()
        self.conn.transport.close()

    async def _send_500(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"),
            (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.want_continue:
            self.want_continue = False
            if not conn.transport.is_closing():
                conn.transport.write(_CONTINUE)
        if not (self.disconnected or self.complete or self.body) and (
                self.more_body or self.delivered):  # a body to wait for, or the end
            conn.resume_reading()
            self.waiter = conn.loop.create_future()
            stall = conn.loop.call_later(STALL_S, self._stalled) if self.more_body else None
            await self.waiter
            self.waiter = None
            if stall is not None:
                stall.cancel()
        if self.disconnected or self.complete:
            return {"type": "http.disconnect"}
        body = self.body
        self.body, self.body_size = [], 0
        self.delivered = not self.more_body
        conn.resume_reading()
        data = body[0] if len(body) == 1 else b"".join(body)
        return {"type": "http.request", "body": data, "more_body": self.more_body}

    async def send(self, message: Any) -> None:
        conn = self.conn
        writable = conn.writable
        if writable is not None and not writable.done() and not self.disconnected:
            try:
                await asyncio.wait_for(asyncio.shield(writable), STALL_S)
            except TimeoutError:
                self._stalled()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got "
                                   f"'{kind}'.")
            self._start(message)
        elif not self.complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got "
                                   f"'{kind}'.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response "
                               f"already completed.")

    def _start(self, message: Any) -> None:
        self.started = True
        if self.want_continue and self.more_body:
            # answered before asking for the body: the client may never send it, and what it
            # sends next would be read as that body (RFC 9110 10.1.1), so the connection closes
            self.keep_alive = False
        self.want_continue = False
        status = message["status"]
        conn = self.conn
        headers = [*conn.server_state.default_headers, *message.get("headers", ())]
        if _BAD_NAME.search(b"".join(name for name, _ in headers)):
            raise RuntimeError("Invalid HTTP header name.")
        if _BAD_VALUE.search(b"".join(value for _, value in headers)):
            raise RuntimeError("Invalid HTTP header value.")
        if conn.access_log:
            scope = self.scope
            _ACCESS_LOG.info('%s - "%s %s HTTP/%s" %d', client_field(scope),
                             scope["method"], target_field(scope),
                             scope["http_version"], status)
        lines = [STATUS_LINE[status]]
        length: int | None = None
        chunked = closing = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and length is None and not chunked:
                length = int(value.decode())
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                length, chunked = None, True
            elif name == b"connection" and b"close" in [
                    token.lower().strip() for token in value.split(b",")]:
                self.keep_alive, closing = False, True
            lines.append(b"%s: %s\r\n" % (name, value))
        if not self.keep_alive and not closing:
            lines.append(b"connection: close\r\n")
        head_request = self.scope["method"] == "HEAD"
        if length is None and not chunked and not head_request and status not in NO_BODY:
            chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        self.chunked = chunked
        self.left = length or 0
        if chunked:
            conn.transport.write(head)  # a stream's head reaches the client before its body
        else:
            self.held = head

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            self.left = 0
            data = b""
        elif self.chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.left:
                self._flush()
                raise RuntimeError("Response content longer than Content-Length")
            self.left -= len(body)
            data = body
        held, self.held = self.held, None
        transport = self.conn.transport
        if held is not None:
            if data:
                transport.writelines((held, data))
            else:
                transport.write(held)
        elif data:
            transport.write(data)
        if not more_body:
            if self.left != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.complete = True
            self.wake()
            if not self.keep_alive:
                transport.close()
            self.conn.answered()

    def _flush(self) -> None:
        if self.held is not None:
            self.conn.transport.write(self.held)
            self.held = None
