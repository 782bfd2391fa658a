"""The floor for any Python proxy on this stack: a pass-through with no work of its own.

A raw ASGI app on uvicorn (uvloop, httptools, with the gateway's own server protocol
gateway.http_server.HttpProtocol), one worker, forwarding each request body unchanged to
the upstream over the gateway's own pooled HTTP/1.1 transport (gateway.backends.http1_transport)
as a `PreparedPost` (each path's head made once), and its answer, read whole, back unchanged with
its length: the same server and upstream client the gateway uses, the same way, none of the
gateway's work (no parsing, lint, tokenizing, routing, records or metrics).
bench_gateway measures it beside the gateway, so the latency a proxy hop itself costs here (two
more processes woken, two more HTTP exchanges) is told apart from the gateway's own.

    python benchmarks/bare_proxy.py PORT UPSTREAM_BASE_URL [gateway|uvicorn]
"""

from __future__ import annotations

import sys
from typing import Any

import httpx
import uvicorn

from gateway.backends.http1_request import PostTemplate, PreparedPost, post_template
from gateway.backends.http1_transport import AnswerBody, Http1Transport
from gateway.http_server import HttpProtocol

_HOP_HEADERS = (b"content-type",)
_TIMEOUTS = {"connect": 10.0, "read": 60.0, "write": 60.0, "pool": 60.0}


class BareProxy:
    """ASGI: `/healthz` answers 200; anything else is forwarded to `upstream` as a POST."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.transport: Http1Transport | None = None
        self.templates: dict[tuple[str, bytes], PostTemplate] = {}  # (path, content type) ->

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/healthz":
            await _answer(send, 200, [], b"ok")
        else:
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.transport = Http1Transport()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.transport is not None:
                    await self.transport.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert self.transport is not None
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        request = PreparedPost(self._template(scope), b"".join(chunks), {"timeout": _TIMEOUTS})
        response = await self.transport.handle_async_request(request)
        try:
            assert isinstance(response.stream, AnswerBody)
            body = await response.stream.whole()
        finally:
            await response.aclose()
        kept = [(k, v) for k, v in response.headers.raw if k.lower() in _HOP_HEADERS]
        kept.append((b"content-length", str(len(body)).encode()))
        await _answer(send, response.status_code, kept, body)

    def _template(self, scope: dict[str, Any]) -> PostTemplate:
        """The POST template for the request's path and content type, made once (as the
        gateway's backends make theirs)."""
        kind = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
        key = (scope["path"], kind)
        template = self.templates.get(key)
        if template is None:
            headers = httpx.Headers({"content-type": kind.decode()} if kind else {})
            template = post_template(httpx.URL(self.upstream + scope["path"]), headers)
            self.templates[key] = template
        return template


async def _answer(send: Any, status: int, headers: list[tuple[bytes, bytes]],
                  body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str]) -> None:
    port, upstream = int(argv[0]), argv[1]
    protocol = argv[2] if len(argv) > 2 else "gateway"
    if protocol not in PROTOCOLS:
        raise SystemExit(f"protocol must be one of {sorted(PROTOCOLS)}, not {protocol!r}")
    uvicorn.run(BareProxy(upstream), host="127.0.0.1", port=port, loop="uvloop",
                http=PROTOCOLS[protocol], log_level="warning")


# the server protocol: the gateway's own (as `prefixgate serve` runs) or uvicorn's httptools one
PROTOCOLS: dict[str, Any] = {"gateway": HttpProtocol, "uvicorn": "httptools"}


if __name__ == "__main__":
    main(sys.argv[1:])
