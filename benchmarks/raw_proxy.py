"""A pass-through proxy with no HTTP server framework: an asyncio protocol and httptools' parser.

The bare proxy (`benchmarks/bare_proxy.py`) serves through uvicorn and ASGI, as the gateway
does; this one parses each request with httptools itself, forwards its body unchanged once it is
whole and writes the answer back in one write, with its length. `bench_hop.py` serves it beside
the bare proxy so the cost of the server layer (uvicorn's protocol, ASGI) is told apart from the
cost of a hop itself. Two upstream clients:

- `transport`: the gateway's own (`Http1Transport`, a `PreparedPost`, the answer read whole);
- `raw`: one keep-alive connection per client connection, one write per request, the answer
  parsed by httptools; no pool, no timeouts: a floor, not a client to serve with.

    python benchmarks/raw_proxy.py PORT UPSTREAM_BASE_URL [transport|raw]
"""

from __future__ import annotations

import asyncio
import sys
from urllib.parse import urlsplit

import httptools
import httpx
import uvloop

from gateway.backends.http1_request import PostTemplate, PreparedPost, post_template
from gateway.backends.http1_transport import AnswerBody, Http1Transport

_TIMEOUTS = {"connect": 10.0, "read": 60.0, "write": 60.0, "pool": 60.0}
_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class Answer(asyncio.Protocol):
    """The `raw` client: one upstream connection; `ask` sends a request, awaits its answer."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    async def ask(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        return await self.waiter


class Front(asyncio.Protocol):
    """One client connection: requests parsed by httptools, each forwarded once whole."""

    def __init__(self, proxy: RawProxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: Answer | None = None
        self.url, self.body = b"", []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_method() == b"GET":
            assert self.transport is not None
            self.transport.write(_OK)
            return
        asyncio.get_running_loop().create_task(self.forward(self.url.decode(),
                                                            b"".join(self.body)))

    async def forward(self, path: str, body: bytes) -> None:
        if self.proxy.client == "raw":
            status, answer = await self._raw(path, body)
        else:
            status, answer = await self.proxy.through_transport(path, body)
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, len(answer), answer))

    async def _raw(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.upstream is None:
            host, port = self.proxy.address
            _, self.upstream = await asyncio.get_running_loop().create_connection(
                Answer, host, port)
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
            (self.proxy.prefix + path).encode(), self.proxy.address[0].encode())
        return await self.upstream.ask(head, body)


class RawProxy:
    """The proxy's shared state: the upstream's address and (for `transport`) the pool."""

    def __init__(self, upstream: str, client: str) -> None:
        self.upstream, self.client = upstream.rstrip("/"), client
        parts = urlsplit(self.upstream)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.prefix = parts.path
        self.pool = Http1Transport()
        self.templates: dict[str, PostTemplate] = {}

    async def through_transport(self, path: str, body: bytes) -> tuple[int, bytes]:
        template = self.templates.get(path)
        if template is None:
            headers = httpx.Headers({"content-type": "application/json"})
            template = post_template(httpx.URL(self.upstream + path), headers)
            self.templates[path] = template
        response = await self.pool.handle_async_request(
            PreparedPost(template, body, {"timeout": _TIMEOUTS}))
        try:
            assert isinstance(response.stream, AnswerBody)
            return response.status_code, await response.stream.whole()
        finally:
            await response.aclose()


async def serve(port: int, proxy: RawProxy) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: Front(proxy), "127.0.0.1",
                                                            port)
    await server.serve_forever()


def main(argv: list[str]) -> None:
    port, upstream = int(argv[0]), argv[1]
    client = argv[2] if len(argv) > 2 else "transport"
    if client not in ("transport", "raw"):
        raise SystemExit(f"client must be transport or raw, not {client!r}")
    uvloop.run(serve(port, RawProxy(upstream, client)))


if __name__ == "__main__":
    main(sys.argv[1:])
