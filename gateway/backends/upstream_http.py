"""HTTP plumbing shared by the upstream backends: client settings, sending, SSE parsing, and
`exchange`, which yields an answer's items and raises its failures as
`gateway.backends.upstream_errors` maps them. Upstream API keys travel only in request headers
and never appear in an error message or a log line.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
import orjson

from gateway.backends.http1_transport import AnswerBody, AnswerFailed, Http1Transport
from gateway.backends.upstream_errors import (
    malformed_answer,
    status_error,
    transport_error,
)
from gateway.types import BackendError, Final, TextDelta, ToolCallDelta


@dataclass(frozen=True, slots=True)
class UpstreamOptions:
    """One upstream replica: where it is, how to authenticate, how long to wait.

    `url` is the API base (`http://host:port/v1` for OpenAI-compatible servers,
    `https://api.anthropic.com` for Anthropic). `derive_prompt_cache_key` None means
    "only for api.openai.com" (other servers may reject the unknown field).
    """

    url: str
    api_key: str | None = None
    timeout_s: float = 600.0  # as `GatewayConfig.upstream_timeout_s`
    name: str | None = None
    max_connections: int = 256
    derive_prompt_cache_key: bool | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {self.url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_connections <= 0:
            raise ValueError(f"max_connections must be positive, got {self.max_connections}")

    @property
    def replica(self) -> str:
        """The replica's display name: given, else host:port of the URL."""
        if self.name:
            return self.name
        url = httpx.URL(self.url)
        return f"{url.host}:{url.port}" if url.port else url.host

    def __repr__(self) -> str:  # never show the key
        return f"UpstreamOptions(url={self.url!r}, replica={self.replica!r})"


class NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class UpstreamClient(httpx.AsyncClient):
    """httpx's client without a cookie jar: one pooled client serves every tenant, so a
    `Set-Cookie` from an upstream answer must never ride along on the next tenant's request
    (and reading it back costs every response a cookie-jar pass)."""

    @property  # type: ignore[misc]
    def cookies(self) -> httpx.Cookies:
        return _NO_COOKIES


_NO_COOKIES = NoCookies()


def client_timeout(options: UpstreamOptions) -> httpx.Timeout:
    """Per-phase timeouts of one replica: connect (at most 10 s), read, write, pool wait."""
    t = options.timeout_s
    return httpx.Timeout(connect=min(t, 10.0), read=t, write=t, pool=t)


def client_limits(options: UpstreamOptions) -> httpx.Limits:
    """Connections of one replica: at most `max_connections`, up to 64 kept alive."""
    return httpx.Limits(max_connections=options.max_connections,
                        max_keepalive_connections=min(options.max_connections, 64))


def make_transport(options: UpstreamOptions) -> httpx.AsyncBaseTransport:
    """The network transport of one replica: httpx's interface over pooled HTTP/1.1
    connections (gateway.backends.http1_transport; aiohttp's client for a proxied origin)."""
    return Http1Transport(client_limits(options))


def make_client(
    options: UpstreamOptions, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """A pooled client for one replica (keep-alive, bounded connections, per-phase timeouts,
    no cookie jar) over `transport`: by default `make_transport`'s; tests and in-process
    benchmarks pass httpx's Mock/ASGI transports."""
    return UpstreamClient(timeout=client_timeout(options), limits=client_limits(options),
                          transport=transport or make_transport(options))


STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def send(transport: httpx.AsyncBaseTransport, request: httpx.Request) -> httpx.Response:
    """Send `request` straight to the client's transport (the request is built complete:
    headers, timeouts; no cookies, auth or redirects to apply), its body streamed; retry once
    when a pooled keep-alive connection turns out closed before any response byte arrived (the
    server dropped it while idle: nothing was processed). Never when the transport says the
    server may have taken the request (`AnswerFailed`: a new connection, or an answer that
    had begun): the upstream would run it twice."""
    try:
        response = await transport.handle_async_request(request)
    except STALE_CONNECTION_ERRORS as exc:
        if isinstance(exc, AnswerFailed):
            raise
        response = await transport.handle_async_request(request)
    response.request = request
    return response


async def whole_answer(response: httpx.Response) -> bytes:
    """A whole answer's body: its bytes as they came when nothing encodes them (not through
    httpx's decoder and chunker), else httpx's decoded read."""
    stream = response.stream
    if type(stream) is AnswerBody and not stream.encoded():  # our transport's: read it whole
        return await stream.whole()
    if "content-encoding" in response.headers or not isinstance(stream, httpx.AsyncByteStream):
        return await response.aread()
    return b"".join([chunk async for chunk in stream])


def dumps_body(body: dict[str, Any]) -> bytes:
    """A request body as compact JSON bytes (orjson; the standard library for what orjson
    refuses, such as integers past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class SSEEvent(NamedTuple):
    """One server-sent event: its `event:` name ("" when absent) and joined `data:` lines."""

    event: str
    data: str


async def iter_sse(response: httpx.Response) -> AsyncIterator[SSEEvent]:
    """Parse a text/event-stream body into events (comments and ids ignored)."""
    event, data = "", list[str]()
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield SSEEvent(event, "\n".join(data))
            event, data = "", list[str]()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            event = line[6:].strip()
    if data:
        yield SSEEvent(event, "\n".join(data))


Item = TextDelta | Final


async def fetch_json(transport: httpx.AsyncBaseTransport, request: httpx.Request,
                     replica: str) -> Any:
    """Send one request and return its JSON answer; failures as `exchange` raises them."""
    try:
        response = await send(transport, request)
        try:
            data = await response.aread()
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise transport_error(exc, replica, started=False) from None
    if response.status_code >= 400:
        raise status_error(response.status_code, data, replica, response.headers)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        raise BackendError(502, "upstream sent malformed JSON",
                           kind="upstream_error", replica=replica) from None


def answered_whole(response: httpx.Response) -> bool:
    """True when a streamed request was answered with one whole JSON body (a server that
    ignores `"stream": true`), not with server-sent events."""
    kind = str(response.headers.get("content-type", ""))
    return kind.split(";", 1)[0].strip().lower() == "application/json"


def whole_as_stream(final: Final) -> tuple[Item, ...]:
    """A whole answer as the items a stream of it yields: one delta with its reasoning, text
    and tool calls (each call's head, then its whole arguments), then the Final, so the
    client of a streamed request still gets a proper stream."""
    calls: list[ToolCallDelta] = []
    for index, call in enumerate(final.tool_calls):
        fn = call["function"]
        calls.append(ToolCallDelta(index, "", id=call["id"], name=fn["name"]))
        if fn["arguments"]:
            calls.append(ToolCallDelta(index, fn["arguments"]))
    if not (final.text or calls or final.reasoning):
        return (final,)
    return (TextDelta(final.text, tool_calls=tuple(calls), reasoning=final.reasoning or ""),
            final)


async def exchange(
    transport: httpx.AsyncBaseTransport,
    request: httpx.Request,
    replica: str,
    *,
    stream: bool,
    read_stream: Callable[[httpx.Response], AsyncGenerator[Item, None]],
    read_whole: Callable[[dict[str, Any]], Final],
    restream: Callable[[Final], tuple[Item, ...]] = whole_as_stream,
) -> AsyncGenerator[Item, None]:
    """Send one request and yield what the upstream answers, as deltas then one Final.

    Both provider backends share this: an HTTP status >= 400, a transport failure, or a 2xx body
    that is not JSON becomes a `BackendError`, marked as mid-stream once anything was yielded.
    A streamed request answered with a whole JSON body is read whole and yielded as a stream
    (`restream`: by default `whole_as_stream`), not taken for a stream cut before its end.
    """
    started = False
    try:
        response = await send(transport, request)
        try:
            if response.status_code >= 400:
                raise status_error(response.status_code, await response.aread(), replica,
                                   response.headers)
            if stream and answered_whole(response):
                final = read_whole(orjson.loads(await whole_answer(response)))
                for item in restream(final):
                    started = True
                    yield item
            elif stream:
                async with aclosing(read_stream(response)) as items:
                    async for item in items:
                        started = True
                        yield item
            else:
                yield read_whole(orjson.loads(await whole_answer(response)))
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise transport_error(exc, replica, started=started) from None
    except (ValueError, TypeError, AttributeError) as exc:  # a 2xx the API would not send
        raise malformed_answer(exc, replica, started=started) from exc
