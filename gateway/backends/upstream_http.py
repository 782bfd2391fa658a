"""HTTP plumbing shared by the upstream backends: client settings, SSE parsing, fault mapping.

Every failure talking to an upstream becomes a `BackendError` whose `kind` says what went wrong
(`upstream_timeout`, `upstream_unavailable`, `upstream_error`, `upstream_stream_cut`, or the
upstream's own 4xx passed through). `is_replica_fault` tells the pool which of them should take
a replica out of routing. Upstream API keys travel only in request headers and never appear in
an error message or a log line.
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
from gateway.types import BackendError, Final, TextDelta, ToolCallDelta

# an overloaded provider (Anthropic's 529 `overloaded_error`) is a fault too: the replica is
# backed off and the request tried on another, as for any answer the provider could not give
REPLICA_FAULT_KINDS = frozenset(
    {"upstream_timeout", "upstream_unavailable", "upstream_error", "upstream_stream_cut",
     "overloaded_error"}
)
#: Anthropic's status for "overloaded" (its `overloaded_error`)
OVERLOADED = 529


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


def transport_error(exc: httpx.HTTPError, replica: str, *, started: bool) -> BackendError:
    """Map an httpx exception to a client-facing error (no URL secrets, no headers)."""
    if isinstance(exc, httpx.TimeoutException):
        return BackendError(504, "upstream timed out", kind="upstream_timeout", replica=replica)
    if started:
        return BackendError(
            502, f"upstream stream was cut mid-way ({type(exc).__name__})",
            kind="upstream_stream_cut", replica=replica,
        )
    if isinstance(exc, httpx.ConnectError | httpx.NetworkError):
        return BackendError(
            502, f"upstream is unreachable ({type(exc).__name__})",
            kind="upstream_unavailable", replica=replica,
        )
    return BackendError(502, f"upstream failed ({type(exc).__name__})",
                        kind="upstream_error", replica=replica)


def _upstream_message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return ""


def status_error(status: int, body: bytes, replica: str, retry_after: str | None = None
                 ) -> BackendError:
    """Map a non-2xx upstream answer to the error the client should see, with the provider's
    `retry-after` (whole seconds) passed on, so a client's SDK backs off as the provider asked."""
    err = _status_error(status, body, replica)
    if retry_after is not None and retry_after.strip().isdigit():
        err.retry_after = int(retry_after)
    return err


def _status_error(status: int, body: bytes, replica: str) -> BackendError:
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    message = _upstream_message(payload)
    detail = f": {message[:500]}" if message else ""
    if status == OVERLOADED:
        return overloaded(detail, replica)
    if status >= 500:
        return BackendError(502, f"upstream answered {status}{detail}",
                            kind="upstream_error", replica=replica)
    if status in (401, 403):
        return BackendError(
            502, f"upstream rejected the gateway's credentials ({status})",
            kind="upstream_auth", replica=replica,
        )
    if status == 429:
        err = BackendError(429, f"upstream is rate limiting{detail}",
                           kind="rate_limit_error", replica=replica)
    else:
        err = BackendError(status, f"upstream refused the request{detail}",
                           kind="invalid_request_error", replica=replica)
    err.code = _upstream_field(payload, "code")
    err.param = _upstream_field(payload, "param")
    return err


def overloaded(detail: str, replica: str) -> BackendError:
    """The provider's own "overloaded" (a 529, or an `overloaded_error` event): passed on as
    Anthropic's 529 `overloaded_error`, which an Anthropic client's SDK knows to back off from
    (`gateway.errors.client_status` makes it an OpenAI client's 503), not as a 502."""
    return BackendError(OVERLOADED, f"upstream is overloaded{detail}",
                        kind="overloaded_error", replica=replica)


def _error_type(payload: Any) -> str | None:
    """The provider's `error.type` of an error body or event (Anthropic's shape)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    value = err.get("type") if isinstance(err, dict) else None
    return value if isinstance(value, str) else None


def _upstream_field(payload: Any, name: str) -> str | None:
    """The provider's own `error.code` or `error.param` of a refusal (OpenAI's shape), when it
    is text: what a client branches on (`context_length_exceeded` to compact its history,
    `insufficient_quota` not to retry, the field to fix), so it reaches the client as the
    provider sent it. A number (vLLM's `code` is the HTTP status) says nothing more: None."""
    err = payload.get("error") if isinstance(payload, dict) else None
    value = err.get(name) if isinstance(err, dict) else None
    return value[:200] if isinstance(value, str) and value else None


def is_replica_fault(err: BackendError) -> bool:
    """True for errors that say the replica is unhealthy (not the request's fault)."""
    return err.kind in REPLICA_FAULT_KINDS


class MalformedAnswer(ValueError):
    """A 2xx answer whose fields are not what the provider's API says they are."""


def token_count(value: Any, field: str) -> int:
    """A count the upstream reported (absent: 0): a whole number >= 0, else `MalformedAnswer`
    naming the field (a count of "many" or -4 is no count at all)."""
    if value is None:
        return 0
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value < 1 << 63 or value != int(value)):
        raise MalformedAnswer(f"{field} is {str(value)[:40]!r}, not a count")
    return int(value)


def malformed_answer(exc: Exception, replica: str, *, started: bool) -> BackendError:
    """A 2xx answer the gateway cannot read: JSON that does not parse, or fields of the wrong
    kind (the replica's fault, not the request's)."""
    if isinstance(exc, orjson.JSONDecodeError):
        what = "malformed JSON"
    elif isinstance(exc, MalformedAnswer):
        what = f"a malformed answer: {exc}"
    else:
        what = f"a malformed answer ({type(exc).__name__})"
    kind = "upstream_stream_cut" if started else "upstream_error"
    return BackendError(502, f"upstream sent {what}", kind=kind, replica=replica)


def loads_event(data: str, replica: str) -> dict[str, Any]:
    """Decode one SSE data payload, as a stream-cut error when it is not a JSON object."""
    try:
        payload = orjson.loads(data)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise BackendError(502, "upstream sent a malformed stream event",
                           kind="upstream_stream_cut", replica=replica)
    return payload


def stream_error_event(payload: dict[str, Any], replica: str) -> BackendError:
    """An error the upstream itself reported inside a 2xx answer (an SSE error event, or a
    whole body that is `{"error": {...}}`): a 502 with the upstream's message, and its
    `error.code` when that is text (as a refusal's is passed on), so the client learns what
    the upstream said rather than that its answer was empty."""
    message = _upstream_message(payload) or "error event"
    if _error_type(payload) == "overloaded_error":
        return overloaded(f": {message[:500]}", replica)
    err = BackendError(502, f"upstream stream error: {message[:500]}",
                       kind="upstream_error", replica=replica)
    err.code = _upstream_field(payload, "code")
    return err


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
        raise status_error(response.status_code, data, replica,
                           response.headers.get("retry-after"))
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
) -> AsyncGenerator[Item, None]:
    """Send one request and yield what the upstream answers, as deltas then one Final.

    Both provider backends share this: an HTTP status >= 400, a transport failure, or a 2xx body
    that is not JSON becomes a `BackendError`, marked as mid-stream once anything was yielded.
    A streamed request answered with a whole JSON body is read whole and yielded as a stream
    (`whole_as_stream`), not taken for a stream cut before its end.
    """
    started = False
    try:
        response = await send(transport, request)
        try:
            if response.status_code >= 400:
                raise status_error(response.status_code, await response.aread(), replica,
                                   response.headers.get("retry-after"))
            if stream and answered_whole(response):
                final = read_whole(orjson.loads(await whole_answer(response)))
                for item in whole_as_stream(final):
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
