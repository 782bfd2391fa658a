"""An httpx transport over aiohttp's client: the upstream backends' network path.

The backends speak httpx (`httpx.Request` in, `httpx.Response` out; tests drive them through
`httpx.MockTransport` and `httpx.ASGITransport`), but httpx's own network stack (httpcore and
the pure-Python h11 parser) costs about twice the CPU of aiohttp's client per proxied request
(measured in `benchmarks/profile_gateway.py --server`). `AiohttpTransport` keeps the httpx
interface and sends through one pooled `aiohttp.ClientSession`:

- connection limits and keep-alive from the backend's `httpx.Limits` (`max_connections` caps
  every connection; aiohttp has no separate cap on idle ones, so `max_keepalive_connections` is
  not applied); per-phase timeouts from the request's `timeout` extension (pool wait + connect,
  connect, per read; aiohttp has no write timeout);
- no cookie jar (`DummyCookieJar`): one pool serves every tenant, so a `Set-Cookie` from one
  answer never rides on another tenant's request; no redirects followed;
- a proxy from the environment (`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`, as httpx reads them)
  is looked up once per origin, not on every request;
- bodies stream through undecoded (httpx decodes `content-encoding` as it would for its own
  transport); the certificate store is certifi's, as httpx's;
- aiohttp's failures are raised as the httpx exceptions the backends already map
  (`gateway.backends.upstream_errors.transport_error`);
- the gateway's `REQUEST_SENT` callback (gateway.types), when set, is called once the body is
  handed to the socket, so that work the body does not depend on (gateway.overlap) runs while
  the upstream works.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import aiohttp
import certifi
import httpx
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import get_env_proxy_for_url
from aiohttp.payload import BytesPayload
from yarl import URL

from gateway.types import REQUEST_SENT


class _Proxy(NamedTuple):
    """The proxy (and its credentials) one origin is reached through; None: direct."""

    url: URL | None
    auth: aiohttp.BasicAuth | None


_SKIP_REQUEST_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding"})


@contextmanager
def _mapped_errors(request: httpx.Request, *, reading: bool) -> Iterator[None]:
    """Raise aiohttp's (and asyncio's timeout) errors as the matching httpx exceptions."""
    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connect timeout", request=request) from exc
    except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timeout", request=request) from exc
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(str(exc), request=request) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
            aiohttp.ClientResponseError) as exc:
        raise httpx.RemoteProtocolError(str(exc), request=request) from exc
    except aiohttp.ClientOSError as exc:
        error = httpx.ReadError if reading else httpx.WriteError
        raise error(str(exc), request=request) from exc
    except aiohttp.ClientError as exc:
        raise httpx.TransportError(str(exc), request=request) from exc


class _ResponseStream(httpx.AsyncByteStream):
    """An aiohttp response body as httpx's async byte stream (chunks as they arrive)."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped_errors(self._request, reading=True):
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        """Back to the pool when the body was read to its end, else the connection is
        closed (its unread rest would corrupt the next answer on it)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class _SignallingBody(BytesPayload):
    """A request body that calls `sent` once its bytes are written to the transport."""

    def __init__(self, body: bytes, sent: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._sent = sent

    async def write_with_length(self, writer: AbstractStreamWriter,
                                content_length: int | None) -> None:
        await super().write_with_length(writer, content_length)
        self._sent()


def _payload(body: bytes) -> bytes | _SignallingBody | None:
    """What aiohttp sends: the bytes, or a body that signals `REQUEST_SENT` once written."""
    if not body:
        return None
    sent = REQUEST_SENT.get()
    return _SignallingBody(body, sent) if sent is not None else body


def _timeout(request: httpx.Request) -> aiohttp.ClientTimeout:
    """aiohttp's timeouts from httpx's `timeout` extension (None: no limit)."""
    t: dict[str, float | None] = request.extensions.get("timeout") or {}
    pool, connect = t.get("pool"), t.get("connect")
    waits = [v for v in (pool, connect) if v is not None]
    return aiohttp.ClientTimeout(total=None, connect=sum(waits) if waits else None,
                                 sock_connect=connect, sock_read=t.get("read"))


async def request_bytes(request: httpx.Request) -> bytes:
    """A request's whole body (read from its stream when it was not built from bytes)."""
    return request.content if hasattr(request, "_content") else await request.aread()


def env_proxy(url: httpx.URL) -> _Proxy:
    """The proxy the environment names for `url` (`HTTP(S)_PROXY`, `NO_PROXY`), else none."""
    try:
        proxy, auth = get_env_proxy_for_url(URL(str(url)))
        return _Proxy(proxy, auth)
    except LookupError:
        return _Proxy(None, None)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """certifi's certificate store, as httpx's: loaded once per process (~20 ms), when the
    first transport is built, not on its first request."""
    return ssl.create_default_context(cafile=certifi.where())


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's transport interface over one pooled aiohttp session (built at first use, on
    the running event loop; `aclose` closes it)."""

    def __init__(self, limits: httpx.Limits | None = None) -> None:
        self._limits = limits or httpx.Limits()
        self.tls = tls_context()
        self._session: aiohttp.ClientSession | None = None
        self._proxies: dict[tuple[str, str, int | None], _Proxy] = {}

    def _proxy(self, url: httpx.URL) -> _Proxy:
        """The environment's proxy for `url`'s origin (read once per origin)."""
        origin = (url.scheme, url.host, url.port)
        found = self._proxies.get(origin)
        if found is None:
            found = self._proxies[origin] = env_proxy(url)
        return found

    def _open(self) -> aiohttp.ClientSession:
        limits = self._limits
        connector = aiohttp.TCPConnector(
            limit=limits.max_connections or 0, limit_per_host=0,
            keepalive_timeout=limits.keepalive_expiry or 5.0,
            ssl=self.tls)
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding",
                                               "Content-Type"))
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send `request`; the answer's body streams from the connection."""
        session = self._session or self._open()
        body = await request_bytes(request)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.lower() not in _SKIP_REQUEST_HEADERS]
        proxy = self._proxy(request.url)
        with _mapped_errors(request, reading=False):
            response = await session.request(
                request.method, str(request.url), data=_payload(body), headers=headers,
                timeout=_timeout(request), allow_redirects=False, proxy=proxy.url,
                proxy_auth=proxy.auth)
        return httpx.Response(response.status, headers=list(response.raw_headers),
                              stream=_ResponseStream(response, request),
                              extensions={"http_version": b"HTTP/1.1"}, request=request)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
