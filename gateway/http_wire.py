"""What the HTTP/1.1 server protocol (gateway.http_server) writes and reads besides the app's
messages: status lines, the connection's addresses, the access-log fields and the 503 app.

The gateway owns these few lines rather than importing them from uvicorn's internal modules:
`pip install` takes the newest uvicorn, and a release that moved one of them would stop
`prefixgate serve` at import. Only uvicorn's public `Config` and its server remain.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

# reading pauses while a request body past this many bytes waits for the app
READ_HIGH_WATER = 64 * 1024
# a request line and headers past this many bytes are refused (431) and the connection closed:
# httptools keeps a head whole in memory, joining each piece to the last, however long it is
MAX_HEAD_BYTES = 64 * 1024


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


STATUS_LINE: Mapping[int, bytes] = {status: _status_line(status) for status in range(100, 600)}


def refusal(status: int, message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A plain-text error response that closes the connection (for a request the server
    refuses before any app sees it)."""
    head = [STATUS_LINE[status]]
    head += [b"%s: %s\r\n" % pair for pair in default_headers]
    text = message.encode("ascii")
    head.append(b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (len(text), text))
    return b"".join(head)


def plain_head(method: bytes, version: str, target: bytes,
               headers: list[tuple[bytes, bytes]]) -> bytes:
    """A request head written again without its `Upgrade` header (a request that asked to
    switch protocols, parsed again as the plain HTTP request it is served as)."""
    lines = [b"%s %s HTTP/%s\r\n" % (method, target, version.encode("ascii"))]
    lines += [b"%s: %s\r\n" % pair for pair in headers if pair[0] != b"upgrade"]
    lines.append(b"\r\n")
    return b"".join(lines)


def _pair(info: Any) -> tuple[str, int] | None:
    """(host, port) from a socket address; None for one that is not an IP pair."""
    if isinstance(info, list | tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


def peer_address(transport: asyncio.BaseTransport) -> tuple[str, int] | None:
    """The client's (host, port); None on a Unix socket."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            return _pair(sock.getpeername())
        except OSError:  # a Unix socket under uvloop may have no peer name
            return None
    return _pair(transport.get_extra_info("peername"))


def local_address(transport: asyncio.BaseTransport) -> tuple[str, int | None] | None:
    """The server's (host, port), or (path, None) on a Unix socket."""
    sock = transport.get_extra_info("socket")
    info = sock.getsockname() if sock is not None else transport.get_extra_info("sockname")
    if isinstance(info, str):
        return info, None
    return _pair(info)


def is_tls(transport: asyncio.BaseTransport) -> bool:
    return bool(transport.get_extra_info("sslcontext"))


def client_field(scope: Mapping[str, Any]) -> str:
    """The access line's client: host:port, empty when unknown."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


def target_field(scope: Mapping[str, Any]) -> str:
    """The access line's request target: the raw path and query, its quotes escaped so the
    quoted field cannot be broken out of."""
    target = str(scope["raw_path"].decode("latin-1"))
    if scope["query_string"]:
        target += "?" + scope["query_string"].decode("latin-1")
    return target.replace('"', "%22")


_BUSY = b"Service Unavailable"


async def service_unavailable(scope: Any, receive: Any,
                              send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """The app served in place of the gateway's past `--limit-concurrency`: a 503 that closes
    the connection."""
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(_BUSY)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": _BUSY})
