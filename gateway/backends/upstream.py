"""The lifecycle every upstream backend shares, in one base class.

`UpstreamBackend` owns what does not depend on the provider's wire format: the pooled HTTP
client (built from `UpstreamOptions`, closed by `aclose`), the configured model ids, the
replica's name, the stream/exchange loop, and the clock that times the first token. A provider
backend adds only its request builder and its two response readers (streamed and whole).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, NamedTuple

import anyio
import httpx

from gateway.backends.http1_request import PostTemplate, PreparedPost, post_template
from gateway.backends.upstream_http import (
    Item,
    UpstreamOptions,
    client_timeout,
    dumps_body,
    exchange,
    fetch_json,
    make_client,
    make_transport,
    whole_as_stream,
)
from gateway.body import INLINE_BYTES, text_chars
from gateway.types import ChatRequest, Final


class Timings(NamedTuple):
    """Seconds to the first text (`ttft`) and per output token after it (`tpot`)."""

    ttft: float
    tpot: float | None


class StreamClock:
    """Times one upstream answer: started when the request is sent, marked at the first text."""

    __slots__ = ("start", "first")

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.first: float | None = None

    def mark(self) -> None:
        """Note that text arrived (only the first call counts)."""
        if self.first is None:
            self.first = time.perf_counter()

    def timings(self, completion_tokens: int) -> Timings:
        """ttft and tpot now that the answer is complete."""
        end = time.perf_counter()
        first = self.first
        tpot = (end - first) / (completion_tokens - 1) if first and completion_tokens > 1 else None
        return Timings((first or end) - self.start, tpot)


class UpstreamBackend(ABC):
    """One upstream replica implementing the `Backend` protocol.

    Subclasses set `name` (the provider kind) and implement `_request` (the provider request
    for a `ChatRequest`), `_read_stream` (SSE response -> deltas and one Final) and
    `_read_whole` (JSON body -> Final). Errors become `BackendError`s in `exchange`.
    """

    name = "upstream"

    def __init__(
        self, options: UpstreamOptions, *, transport: httpx.AsyncBaseTransport | None = None,
        models: tuple[str, ...] = (),
    ) -> None:
        self.options = options
        self.replica = options.replica
        self._models = list(models)
        self._transport = transport or make_transport(options)
        self._client = make_client(options, self._transport)  # probes; closes the transport
        self._base = options.url.rstrip("/")
        self.models_url = self._base + "/models"  # GET: the models the upstream serves
        # built once: the client's default headers (accept, accept-encoding, user-agent) with
        # the backend's own, and the timeouts every request carries to the transport
        self._header_obj = httpx.Headers(self._client.headers)
        self._header_obj.update(self._headers())
        self._extensions = {"timeout": client_timeout(options).as_dict()}
        self._templates: dict[str, PostTemplate] = {}  # by URL: a backend POSTs to a fixed few

    def models(self) -> list[str]:
        """The model ids configured for this replica (empty: any model is passed on)."""
        return list(self._models)

    def kv_pages(self) -> tuple[int, int] | None:
        """Upstreams do not expose their KV pool."""
        return None

    async def list_models(self) -> list[str]:
        """The configured model ids, else the ids the upstream lists at `models_url`."""
        if self._models:
            return list(self._models)
        listing = await self.get_json(self.models_url)
        data = listing.get("data") if isinstance(listing, dict) else None
        return [m["id"] for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def get_json(self, url: str) -> Any:
        """GET `url` (a probe: `/props`, `/v1/models`) with this replica's credentials; its
        JSON, or None when it does not answer 200 with JSON within 5 s."""
        try:
            response = await self._client.get(url, headers=self._header_obj, timeout=5.0)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def family_in_body(self, req: ChatRequest) -> bool:
        """Whether the body sent for `req` depends on its prompt family (see subclasses)."""
        return False

    def prefill_saved_ms(self, cached_tokens: int) -> float:
        """The prefill time `cached_tokens` cached prompt tokens save on this upstream, in ms:
        0 for an upstream that does not time its prefill (prefixgate claims none)."""
        return 0.0

    async def aclose(self) -> None:
        """Close the pooled HTTP client."""
        await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        """Request headers (content type and credentials); subclasses extend."""
        return {"content-type": "application/json"}

    def _template(self, url: httpx.URL) -> PostTemplate:
        """What the backend's POSTs to `url` share (its headers), made once per URL."""
        found = self._templates.get(str(url))
        if found is None:
            found = self._templates[str(url)] = post_template(url, self._header_obj)
        return found

    def _post(self, template: PostTemplate, content: bytes) -> httpx.Request:
        """A complete POST request (headers and timeouts), sent straight to the transport."""
        return PreparedPost(template, content, dict(self._extensions))

    async def _post_json(self, url: httpx.URL | str, body: dict[str, Any]) -> Any:
        """POST `body` to `url` and return the JSON answer (failures as `fetch_json` raises
        them)."""
        request = self._post(self._template(httpx.URL(url)), dumps_body(body))
        return await fetch_json(self._transport, request, self.replica)

    @abstractmethod
    def _request(self, req: ChatRequest) -> httpx.Request:
        """The provider request for `req`."""

    @abstractmethod
    def _read_stream(
        self, response: httpx.Response, clock: StreamClock, req: ChatRequest
    ) -> AsyncGenerator[Item, None]:
        """Deltas, then one Final, from a streamed answer (call `clock.mark()` at text)."""

    @abstractmethod
    def _read_whole(self, payload: Any, clock: StreamClock, req: ChatRequest) -> Final:
        """The Final of a whole (non-streamed) JSON answer."""

    def _restream(self, final: Final) -> tuple[Item, ...]:
        """A whole answer to a streamed request as the items a stream of it yields."""
        return whole_as_stream(final)

    async def stream(self, req: ChatRequest) -> AsyncGenerator[Item, None]:
        """Text deltas, then exactly one Final. Raises BackendError on failure. A large
        body is serialised in a worker thread (the event loop only routes)."""
        if text_chars(req.messages, req.prompt) > INLINE_BYTES:
            request = await anyio.to_thread.run_sync(self._request, req)
        else:
            request = self._request(req)
        clock = StreamClock()
        items = exchange(
            self._transport, request, self.replica, stream=req.stream,
            read_stream=lambda response: self._read_stream(response, clock, req),
            read_whole=lambda payload: self._read_whole(payload, clock, req),
            restream=self._restream)
        async with aclosing(items):
            async for item in items:
                yield item
