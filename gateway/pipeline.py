"""One request through the gateway: auth, body, parse, lint, backend stream, response, record.

Every request, whatever happens to it, leaves exactly one RequestRecord and carries the
x-prefixgate-* headers. An ApiError before the first delta becomes an error response in the
client's format; after it (streaming) an SSE error event. Once the body is read, a disconnect is
watched for at every stage (admission queue, lint, prefill, decode): a client that goes away
cancels the backend stream, which aborts the engine request (status 499 in the record).
Admission (gateway.admission) runs before any work; CPU work (lint) runs in a worker thread so
the event loop only routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import anyio
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway import render_anthropic, render_openai
from gateway.admission import Admission, AdmissionConfig, Overloaded, Slot
from gateway.auth import tenant_for
from gateway.body import INLINE_BYTES, cap_max_tokens, parse_body
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, error_body
from gateway.lint_stage import MODE_HEADER, LintStage, request_mode
from gateway.metrics import GatewayMetrics
from gateway.salt import UpstreamSalter
from gateway.stats import RecordStore
from gateway.types import (
    ApiError,
    Backend,
    BackendError,
    ChatRequest,
    Final,
    PreparingBackend,
    Provider,
    TextDelta,
    Usage,
)
from gateway.usage_report import SUMMARY_FIELD, summary, usage_headers
from gateway.validate import ParseContext
from prompt_lint.memo import LOCK as MEMO_LOCK

log = logging.getLogger("prefixgate.gateway")
CLIENT_CLOSED = 499
INLINE_PARSE_BYTES = INLINE_BYTES  # bodies above this are parsed in a worker thread
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class FastJSONResponse(JSONResponse):
    """A JSON response encoded by orjson (compact UTF-8, as Starlette's own, several times
    faster for a large completion)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class Chunks(Protocol):
    """A streaming renderer for one response."""

    def delta(self, item: TextDelta) -> bytes: ...
    def final(self, final: Final) -> bytes: ...


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """How one route parses bodies and renders results."""

    name: str  # "chat.completions" | "completions" | "messages"
    provider: Provider
    parse: Callable[[dict[str, Any], ParseContext], ChatRequest]
    render: Callable[[ChatRequest, Final, int], dict[str, Any]]
    stream_start: Callable[[ChatRequest, Usage | None], tuple[Chunks, bytes]]


@dataclass
class Gateway:
    """The state every route shares (also on app.state)."""

    config: GatewayConfig
    backend: Backend
    store: RecordStore
    metrics: GatewayMetrics
    lint: LintStage = field(default_factory=LintStage)
    admission: Admission | None = None  # None: built from config
    salter: UpstreamSalter | None = None  # None: built from config

    def __post_init__(self) -> None:
        c = self.config
        if self.admission is None:
            self.admission = Admission(AdmissionConfig(
                max_concurrency=c.max_concurrency, max_queue=c.max_queue,
                tenant_max_concurrency=c.tenant_max_concurrency,
                tenant_rate_per_s=c.tenant_rate_per_s, tenant_burst=c.tenant_burst))
        if self.salter is None:
            self.salter = UpstreamSalter(c.salt_secret)


_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    """A 24-hex-digit id unique across processes: a random per-process prefix and a counter
    (cheaper than a uuid4 per request, which costs a system call)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFFFFFFFFFF:012x}"


@dataclass
class Ticket:
    """What is known so far about one request, for its record and headers."""

    route: RouteSpec
    request_id: str = field(default_factory=lambda: new_request_id())
    started: float = field(default_factory=time.perf_counter)
    tenant: str = ""
    req: ChatRequest | None = None
    body: dict[str, Any] | None = None
    recorded: bool = False
    slot: Slot | None = None


def prefixgate_headers(usage: Usage | None, lint_ids: tuple[str, ...], request_id: str) -> dict[
    str, str
]:
    """The x-prefixgate-* headers of a response (see `gateway.usage_report`)."""
    return {"x-request-id": request_id, **usage_headers(usage),
            "x-prefixgate-lint": ",".join(lint_ids)}


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 naming the body when it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body exceeds {limit} bytes", param="body")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body exceeds {limit} bytes", param="body")
        chunks.append(chunk)
    return b"".join(chunks)


Started = tuple[ChatRequest, AsyncIterator[TextDelta | Final], TextDelta | Final]


async def handle(gw: Gateway, request: Request, route: RouteSpec) -> Response:
    """Serve one request on `route`."""
    ticket = Ticket(route)
    gw.metrics.in_flight.inc()
    try:
        ticket.tenant = tenant_for(request, gw.config)
        raw = await read_body(request, gw.config.max_body_bytes)
        started = await _unless_disconnected(request, _start(gw, request, ticket, raw))
    except Overloaded as err:
        return _error_response(gw, ticket, err, {"retry-after": str(err.retry_after)})
    except ApiError as err:
        return _error_response(gw, ticket, err)
    except ClientDisconnect:
        _record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:  # noqa: BLE001 - a bug must not take the gateway down
        return _error_response(gw, ticket, _internal(exc))
    if started is None:
        _record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected before the answer")
        return Response(status_code=CLIENT_CLOSED)
    req, stream, first = started
    if req.stream:
        return _streaming_response(gw, ticket, req, first, stream)
    return await _json_response(gw, request, ticket, req, first, stream)


async def _unless_disconnected(request: Request, work: Any) -> Started | None:
    """Run `work` (a coroutine) while watching the client; None when it disconnected first
    (the work is then cancelled, which closes any backend stream it opened)."""
    task: asyncio.Future[Started] = asyncio.ensure_future(work)
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (server shutdown): stop the work too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):  # the client is gone: nothing to report
        await task
    return None


async def _start(gw: Gateway, request: Request, ticket: Ticket, raw: bytes) -> Started:
    """Admit, prepare and start the backend stream up to its first item."""
    assert gw.admission is not None
    ticket.slot = await gw.admission.acquire(ticket.tenant)
    req = await _prepare(gw, request, ticket, raw)
    stream = gw.backend.stream(req)
    try:
        first = await _first(stream)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _close(stream)
        raise
    return req, stream, first


async def _prepare(gw: Gateway, request: Request, ticket: Ticket, raw: bytes) -> ChatRequest:
    mode = request_mode(request.headers.get(MODE_HEADER), gw.config.lint_mode)
    ctx = ParseContext(ticket.request_id, ticket.tenant, tuple(gw.backend.models()))
    if len(raw) > INLINE_PARSE_BYTES:  # a large body is parsed and validated off the loop
        body, req = await anyio.to_thread.run_sync(_parse, gw.config, ticket, raw, ctx)
    else:
        body, req = _parse(gw.config, ticket, raw, ctx)
    if not _lint_fits(gw.config, body, len(raw)):
        mode = "off"
    req, lint_ids = await anyio.to_thread.run_sync(_lint_and_prepare, gw, body, req, ticket,
                                                   mode, ctx)
    ticket.req = req
    for rule in lint_ids:
        gw.metrics.lint_findings.inc(rule=rule)
    return req


def _lint_and_prepare(gw: Gateway, body: dict[str, Any], req: ChatRequest, ticket: Ticket,
                      mode: Any, ctx: ParseContext) -> tuple[ChatRequest, tuple[str, ...]]:
    """All of a request's CPU work in one worker-thread call (one hop off the event loop):
    lint, the re-parse of a rewritten body, and the backend's `prepare` (tokenize and pack
    once for the shadow caches); under prompt_lint's lock (its learners and memos are
    process-wide and not thread-safe)."""
    assert gw.salter is not None
    with MEMO_LOCK:
        outcome = gw.lint.run(body, ticket.route.provider, ticket.tenant, mode)
        if outcome.changed:
            req = ticket.route.parse(outcome.body, ctx)
        req = replace(req, lint_ids=outcome.lint_ids, family=outcome.family,
                      upstream_salt=gw.salter.salt(req.namespace))
        if isinstance(gw.backend, PreparingBackend):
            req = gw.backend.prepare(req)
    return req, outcome.lint_ids


def _parse(config: GatewayConfig, ticket: Ticket, raw: bytes, ctx: ParseContext
           ) -> tuple[dict[str, Any], ChatRequest]:
    """The body (max_tokens capped) and the validated request."""
    body = cap_max_tokens(parse_body(raw, config.max_json_depth), config.max_tokens_cap)
    ticket.body = body
    req = ticket.route.parse(body, ctx)  # validate what the client sent
    ticket.req = req
    return body, req


def _lint_fits(config: GatewayConfig, body: dict[str, Any], size: int) -> bool:
    """Lint work is bounded per request: larger bodies are served unlinted."""
    messages = body.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    if size <= config.lint_max_bytes and count <= config.lint_max_messages:
        return True
    log.info("body of %d bytes / %d messages is over the lint budget; not linted", size, count)
    return False


async def _first(stream: AsyncIterator[TextDelta | Final]) -> TextDelta | Final:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise BackendError(502, "backend returned no output") from None


def _error_response(gw: Gateway, ticket: Ticket, err: ApiError,
                    extra: dict[str, str] | None = None) -> Response:
    _record(gw, ticket, err.status, None, error=err.message)
    lint_ids = ticket.req.lint_ids if ticket.req else ()
    headers = {**prefixgate_headers(None, lint_ids, ticket.request_id), **(extra or {})}
    body = error_body(err, ticket.route.provider)
    return JSONResponse(body, status_code=err.status, headers=headers)


async def _json_response(
    gw: Gateway, request: Request, ticket: Ticket, req: ChatRequest,
    first: TextDelta | Final, stream: AsyncIterator[TextDelta | Final],
) -> Response:
    try:
        final = await _until_final(request, first, stream)
    except ApiError as err:
        return _error_response(gw, ticket, err)
    except Exception as exc:  # noqa: BLE001
        return _error_response(gw, ticket, _internal(exc))
    except BaseException:  # cancelled (server shutdown): still one record
        _record(gw, ticket, CLIENT_CLOSED, None, error="cancelled")
        raise
    if final is None:
        _record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected")
        return Response(status_code=CLIENT_CLOSED)
    _record(gw, ticket, 200, final)
    body = ticket.route.render(req, final, int(time.time()))
    body[SUMMARY_FIELD] = summary(final.usage)
    headers = prefixgate_headers(final.usage, req.lint_ids, ticket.request_id)
    return FastJSONResponse(body, headers=headers)


async def _until_final(
    request: Request, first: TextDelta | Final, stream: AsyncIterator[TextDelta | Final]
) -> Final | None:
    """Drain the stream to its Final; None when the client disconnected first (the backend
    stream is then cancelled, which aborts the engine request)."""
    if isinstance(first, Final):  # a non-streaming upstream: the answer is already here
        await _close(stream)
        return first

    async def drain() -> Final:
        item: TextDelta | Final = first
        while not isinstance(item, Final):
            item = await stream.__anext__()
        return item

    task = asyncio.ensure_future(drain())
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        return task.result()
    except StopAsyncIteration:
        raise BackendError(502, "backend ended without a result") from None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await _close(stream)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _close(stream: AsyncIterator[TextDelta | Final]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001 - closing must not mask the real outcome
            log.exception("closing a backend stream failed")


def _streaming_response(
    gw: Gateway, ticket: Ticket, req: ChatRequest,
    first: TextDelta | Final, stream: AsyncIterator[TextDelta | Final],
) -> Response:
    early = first.usage if isinstance(first, Final) else first.usage
    chunks, head = ticket.route.stream_start(req, early)
    headers = {**prefixgate_headers(early, req.lint_ids, ticket.request_id), **SSE_HEADERS}
    body = _sse_body(gw, ticket, chunks, head, first, stream)

    async def cleanup() -> None:  # runs even when the body was never iterated
        _record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected")
        await _close(stream)

    return _GatewayStream(body, cleanup, media_type="text/event-stream", headers=headers)


class _GatewayStream(StreamingResponse):
    """A StreamingResponse that always runs `cleanup`, shielded from cancellation."""

    def __init__(
        self, body: AsyncIterator[bytes], cleanup: Callable[[], Any], **kwargs: Any
    ) -> None:
        super().__init__(body, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


async def _sse_body(
    gw: Gateway, ticket: Ticket, chunks: Chunks, head: bytes,
    first: TextDelta | Final, stream: AsyncIterator[TextDelta | Final],
) -> AsyncIterator[bytes]:
    status, final = CLIENT_CLOSED, None
    error: str | None = "client disconnected"
    try:
        if head:
            yield head
        item = first
        while True:
            if isinstance(item, Final):
                final, status, error = item, 200, None
                yield chunks.final(item)
                return
            piece = chunks.delta(item)
            if piece:
                yield piece
            item = await anext(stream)
    except StopAsyncIteration:
        status, error = 502, "backend ended without a result"
        yield _stream_error(ticket, BackendError(502, error))
    except ApiError as err:
        status, error = err.status, err.message
        yield _stream_error(ticket, err)
    except Exception as exc:  # noqa: BLE001
        internal = _internal(exc)
        status, error = internal.status, internal.message
        yield _stream_error(ticket, internal)
    finally:
        _record(gw, ticket, status, final, error=error)
        with anyio.CancelScope(shield=True):
            await _close(stream)


def _internal(exc: BaseException) -> BackendError:
    log.exception("request failed inside the gateway", exc_info=exc)
    return BackendError(500, f"internal gateway error: {type(exc).__name__}")


def _stream_error(ticket: Ticket, err: ApiError) -> bytes:
    body = error_body(err, ticket.route.provider)
    if ticket.route.provider == "anthropic":
        return render_anthropic.error_event(body)
    return render_openai.error_event(body)


def _record(
    gw: Gateway, ticket: Ticket, status: int, final: Final | None, *, error: str | None = None
) -> None:
    """Store the one record of this request and update the metrics."""
    if ticket.recorded:
        return
    ticket.recorded = True
    if ticket.slot is not None:
        ticket.slot.release()
    gw.metrics.in_flight.dec()
    latency = time.perf_counter() - ticket.started
    usage = final.usage if final else None
    backend = gw.backend.name
    gw.metrics.requests.inc(route=ticket.route.name, status=str(status), backend=backend)
    gw.metrics.latency.observe(latency, route=ticket.route.name)
    if usage is not None:
        gw.metrics.observe_usage(usage, backend)
    gw.store.add(_make_record(gw, ticket, status, final, error, latency))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _make_record(
    gw: Gateway, ticket: Ticket, status: int, final: Final | None, error: str | None,
    latency: float,
) -> dict[str, Any]:
    """The record's column values: a plain dict, so no ORM object is built on the request
    path (the store's writer thread inserts the rows in batches)."""
    req, usage = ticket.req, (final.usage if final else None)
    body = ticket.body or {}
    return dict(
        ts=datetime.now(UTC),
        request_id=ticket.request_id,
        tenant=ticket.tenant or "-",
        model=req.model if req else str(body.get("model", ""))[:256],
        backend=gw.backend.name,
        replica=final.replica if final else None,
        provider=ticket.route.provider,
        route=ticket.route.name,
        status=status,
        error=error,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        cached_tokens=usage.cached_tokens if usage else 0,
        predicted_cached_tokens=usage.predicted_cached_tokens if usage else None,
        reported_cached_tokens=usage.reported_cached_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else 0,
        ttft_ms=_ms(usage.ttft) if usage else None,
        tpot_ms=_ms(usage.tpot) if usage else None,
        latency_ms=latency * 1000.0,
        prefill_saved_ms=usage.prefill_saved_ms if usage else 0.0,
        usage_estimated=usage.estimated if usage else False,
        lint_ids=",".join(req.lint_ids) if req else "",
        family=req.family if req else None,
        stream=bool(req.stream) if req else bool(body.get("stream", False)),
        prompt_text=_prompt_text(gw, req),
    )


def _prompt_text(gw: Gateway, req: ChatRequest | None) -> str | None:
    if not gw.config.store_prompts or req is None:
        return None
    if req.prompt is not None:
        return req.prompt
    return json.dumps({"messages": req.messages, "tools": req.tools}, ensure_ascii=False)
