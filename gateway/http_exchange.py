"""One request and its response on a connection of `gateway.http_server`: the ASGI `receive`
and `send` of one app call, and the bytes of the response's head and body.

A response with a declared length (or none) has its head held and written with its first body
chunk, in one write; a stream's head goes out at once, its chunks framed as they come. A header
name or value that could split the head (a control character) fails the app's send, as in
uvicorn. A client that sends none of a body the app awaits, or takes none of the response while
the socket's buffer is full, for `STALL_S` seconds is taken as gone: the connection is aborted
and the app hears `http.disconnect`. A body that keeps arriving, but slower than
`MIN_BODY_RATE` bytes a second on average over the time the app waited for it (once
`BODY_GRACE_S` seconds were waited), is refused with a 408 and the connection closed: a byte
every minute would otherwise hold the request, and its tenant's concurrency slot, for as long
as the client liked.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any

from gateway.http_wire import STATUS_LINE, client_field, refusal, target_field

if TYPE_CHECKING:
    from gateway.http_server import HttpProtocol

NO_BODY = frozenset({204, 304})
_BAD_NAME = re.compile(rb'[\x00-\x1f\x7f()<>@,;:\[\]={} \t\\"]')  # not a token character
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # a control character other than tab
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# a client whose request body, awaited by the app, or whose reading of the response makes no
# progress for this many seconds is taken as gone (a vanished peer is otherwise never noticed)
STALL_S = 60.0
MIN_BODY_RATE = 1024.0  # bytes per second waited, once BODY_GRACE_S were waited
BODY_GRACE_S = 10.0
ERROR_LOG = logging.getLogger("uvicorn.error")
ACCESS_LOG = logging.getLogger("uvicorn.access")


class Exchange:
    """One request and its response: the ASGI `receive` and `send` of one app call."""

    __slots__ = ("body", "body_size", "chunked", "complete", "conn", "delivered", "disconnected",
                 "held", "keep_alive", "left", "more_body", "received", "scope", "started",
                 "waited", "waiter", "want_continue")

    def __init__(self, conn: HttpProtocol, scope: dict[str, Any], *, keep_alive: bool,
                 expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.want_continue = expect_continue
        self.body: list[bytes] = []
        self.body_size = 0
        self.received = 0  # the body's bytes so far
        self.waited = 0.0  # seconds the app has waited for them
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
            ERROR_LOG.error("Exception in ASGI application\n", exc_info=exc)
            if not self.started:
                await self._send_500()
            else:
                self._close()
        else:
            if result is not None:
                ERROR_LOG.error("ASGI callable should return None, but returned '%s'.", result)
                self._close()
            elif not self.started and not self.disconnected:
                ERROR_LOG.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.complete and not self.disconnected:
                ERROR_LOG.error("ASGI callable returned without completing response.")
                self._close()

    def _stalled(self) -> None:
        """No byte of the awaited body, or none of the response taken, for `STALL_S` seconds:
        the connection closes and the app hears `http.disconnect` (held forever, it would keep
        its tenant's concurrency slot, and a stream its KV pages)."""
        ERROR_LOG.warning("Client made no progress for %.0f s; closing the connection.",
                           STALL_S)
        self.hang_up()
        self.conn.transport.abort()  # a close would wait for the unread response to drain

    def _watch_body(self) -> asyncio.TimerHandle:
        """The timer that ends a wait for more of the body: `STALL_S` without a byte, or sooner
        where the body would fall under `MIN_BODY_RATE`."""
        allowed = max(BODY_GRACE_S, self.received / MIN_BODY_RATE) - self.waited
        if allowed < STALL_S:
            return self.conn.loop.call_later(max(allowed, 0.0), self._too_slow)
        return self.conn.loop.call_later(STALL_S, self._stalled)

    def _too_slow(self) -> None:
        """The body arrives slower than `MIN_BODY_RATE`: a 408 (unless the response began) and
        the connection closes; the app hears `http.disconnect`."""
        ERROR_LOG.warning("Request body arriving slower than %.0f bytes/s; closing the "
                          "connection.", MIN_BODY_RATE)
        conn = self.conn
        if not self.started and not conn.transport.is_closing():
            conn.transport.write(refusal(408, "Request body arrived too slowly.",
                                         conn.server_state.default_headers))
        self.hang_up()
        conn.transport.close()

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
            stall = self._watch_body() if self.more_body else None
            began = conn.loop.time()
            await self.waiter
            self.waiter = None
            if stall is not None:
                stall.cancel()
                self.waited += conn.loop.time() - began
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
            ACCESS_LOG.info('%s - "%s %s HTTP/%s" %d', client_field(scope),
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
