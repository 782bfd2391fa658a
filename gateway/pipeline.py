"""One request through the gateway: auth, body, parse, lint, backend stream, response, record.

Every request, whatever happens to it, leaves exactly one RequestRecord and carries the
x-prefixgate-* headers. An ApiError before the first delta becomes an error response in the
client's format; after it (streaming) an SSE error event. Once the body is read, a disconnect is
watched for at every stage (admission queue, lint, prefill, decode): a client that goes away
cancels the backend stream, which aborts the engine request (status 499 in the record).
Admission (gateway.admission) runs before any work. A request's CPU work is lint and the
backend's `prepare` (tokenizing for the shadow caches); as much of it as the sent body does not
depend on runs while the upstream works (gateway.overlap). Report-mode lint changes nothing
that is sent, so for an upstream pool it waits until the request is on its way (the backend's
transport calls `REQUEST_SENT` once the body is on the socket); its findings still reach the
response headers and the record. Rewrite mode, and an upstream whose body carries the prompt
family (api.openai.com's `prompt_cache_key`), lint before sending. A one-replica pool tokenizes
while its upstream works as well (`ReplicaPool.sends_before_tokens`), or, for a whole answer
from a replica that reports its own figures, after the answer is sent (lint then lays the body
out for both: `LayoutShare`). Each piece of that work is
one call made in a worker thread so the event loop only routes, except for a body of at most
`GatewayConfig.inline_prepare_bytes` (64 KiB) while prompt_lint's lock is free: that work is
shorter than the thread hop itself (bench_gateway, 4k-token requests) and runs on the loop. A
lock held by a worker thread never blocks the loop: the request then takes the worker thread
too. An answer is sent before its bookkeeping: the backend stream is closed and the record
written once the whole response is on its way (a stream's: after its last byte,
gateway.sse_response).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from gateway.answer import (
    error_response,
    first_item,
    json_response,
    stream_response,
    wait_disconnect,
)
from gateway.body import INLINE_BYTES, cap_max_tokens, media_chars, parse_body
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.evolve import evolve
from gateway.lint_stage import MODE_HEADER, request_mode
from gateway.overlap import cpu_work, first_while_sent
from gateway.request_record import record
from gateway.request_state import CLIENT_CLOSED, Gateway, RouteSpec, Ticket
from gateway.sse_response import close_stream, internal_error
from gateway.types import (
    ApiError,
    ChatRequest,
    Final,
    LayoutShare,
    TextDelta,
)
from gateway.validate import ParseContext

log = logging.getLogger("prefixgate.gateway")
INLINE_PARSE_BYTES = INLINE_BYTES  # bodies above this are parsed in a worker thread


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 naming the body when it passes `limit` bytes (read from the ASGI
    messages themselves: a body that came whole is returned as it came, not copied)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body exceeds {limit} bytes", param="body")
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body exceeds {limit} bytes", param="body")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


Started = tuple[ChatRequest, AsyncIterator[TextDelta | Final], TextDelta | Final]


async def handle(gw: Gateway, request: Request, route: RouteSpec) -> Response:
    """Serve one request on `route`."""
    ticket = Ticket(route)
    gw.metrics.in_flight.inc()
    gw.unrecorded += 1
    try:
        ticket.tenant = gw.auth.tenant(request)
        assert gw.admission is not None
        with gw.admission.reading_body(ticket.tenant):  # slow bodies count toward its limit
            raw = await read_body(request, gw.config.max_body_bytes)
        started = await _unless_disconnected(request, _start(gw, request, ticket, raw))
    except ApiError as err:
        return error_response(gw, ticket, err)
    except ClientDisconnect:
        record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected")
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:  # noqa: BLE001 - a bug must not take the gateway down
        return error_response(gw, ticket, internal_error(exc))
    except asyncio.CancelledError:  # by the server (a forced shutdown): still one record
        record(gw, ticket, CLIENT_CLOSED, None, error="cancelled")
        raise
    if started is None:
        record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected before the answer")
        return Response(status_code=CLIENT_CLOSED)
    req, stream, first = started
    if req.stream:
        return await stream_response(gw, ticket, req, first, stream)
    return await json_response(gw, request, ticket, req, first, stream)


async def _unless_disconnected(request: Request, work: Any) -> Started | None:
    """Run `work` (a coroutine) in this task while a watcher task listens for the client
    going away; None when it did (the work is then cancelled, which closes any backend
    stream it opened)."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await wait_disconnect(request)
        gone = True
        task.cancel()

    watcher: asyncio.Future[Any] = asyncio.ensure_future(watch())
    try:
        result: Started = await work
        return result
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        return None
    finally:
        watcher.cancel()


async def _start(gw: Gateway, request: Request, ticket: Ticket, raw: bytes) -> Started:
    """Admit, prepare and start the backend stream up to its first item."""
    assert gw.admission is not None
    ticket.slot = await gw.admission.acquire(ticket.tenant)
    req, lint_after = await _prepare(gw, request, ticket, raw)
    if lint_after is not None:
        return await _start_then_lint(gw, ticket, req, lint_after)
    stream = gw.backend.stream(req)
    try:
        first = await first_item(stream)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close_stream(stream)
        raise
    return req, stream, first


class _LintJob(NamedTuple):
    """Report-mode lint left until the request is on its way upstream."""

    body: dict[str, Any]
    size: int


async def _prepare(gw: Gateway, request: Request, ticket: Ticket, raw: bytes
                   ) -> tuple[ChatRequest, _LintJob | None]:
    """The validated, linted (or to be linted: the job) and prepared request."""
    mode = request_mode(request.headers.get(MODE_HEADER), gw.config.lint_mode)
    ctx = gw.parse_context(ticket.request_id, ticket.tenant)
    if len(raw) > INLINE_PARSE_BYTES:  # a large body is parsed and validated off the loop
        body, req = await anyio.to_thread.run_sync(_parse, gw.config, ticket, raw, ctx)
    else:
        body, req = _parse(gw.config, ticket, raw, ctx)
    if ticket.route.provider == "anthropic":
        req = with_beta(request, req)
        ticket.req = req
    if not _lint_fits(gw.config, body, len(raw)):
        mode = "off"
    if mode == "report" and _lint_can_wait(gw, req):
        req = await _cpu_work(gw, len(raw), _prepare_only, gw, req, ticket)
        ticket.req = req
        return req, _LintJob(body, len(raw))
    req = await _cpu_work(gw, len(raw), _lint_and_prepare, gw, body, req, ticket, mode)
    ticket.req = req
    return req, None


def with_beta(request: Request, req: ChatRequest) -> ChatRequest:
    """An Anthropic client's request with its `anthropic-beta` header, for an Anthropic
    upstream (the only client header passed on; its credentials never are)."""
    beta = request.headers.get("anthropic-beta")
    return evolve(req, anthropic_beta=beta) if beta else req


def _lint_can_wait(gw: Gateway, req: ChatRequest) -> bool:
    """Report-mode lint changes nothing that is sent, so it can run while an upstream works,
    unless the upstream body carries the prompt family (api.openai.com's cache key)."""
    return gw.preparing is not None and not gw.preparing.family_in_body(req)


async def _start_then_lint(gw: Gateway, ticket: Ticket, req: ChatRequest, job: _LintJob
                           ) -> Started:
    """Start the backend stream, lint once the request is sent (or its first item is back,
    for a backend that does not say), then wait for the first item."""
    stream = gw.backend.stream(req)

    async def lint() -> ChatRequest:
        linted = await _cpu_work(gw, job.size, _lint, gw, job.body, req, ticket, "report")
        ticket.req = linted
        return linted

    try:
        first, req = await first_while_sent(lambda: first_item(stream), lint)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close_stream(stream)
        raise
    return req, stream, first


async def _cpu_work(gw: Gateway, size: int, work: Callable[..., ChatRequest], *args: Any
                    ) -> ChatRequest:
    """`work(*args)` under prompt_lint's lock, inline for a body of at most
    `inline_prepare_bytes` (gateway.overlap.cpu_work)."""
    return await cpu_work(size, gw.config.inline_prepare_bytes, work, *args)


def _lint_and_prepare(gw: Gateway, body: dict[str, Any], req: ChatRequest, ticket: Ticket,
                      mode: Any) -> ChatRequest:
    """A request's CPU work before it is sent, in one call (one hop off the event loop, or
    inline for a small body): lint (and the re-parse of a rewritten body), then the backend's
    `prepare` (tokenize and pack once for the shadow caches); under prompt_lint's lock (its
    learners and memos are process-wide and not thread-safe). Lint lays the body out for
    the shadow's tokens too (`LayoutShare`; a rewritten body is laid out again)."""
    linted = _lint(gw, body, evolve(req, layout_share=LayoutShare()), ticket, mode)
    return _prepare_only(gw, linted, ticket)


def _prepare_only(gw: Gateway, req: ChatRequest, ticket: Ticket) -> ChatRequest:
    """The tenant's upstream salt and the backend's `prepare`, without lint; the request's
    token layout is shared by the shadow's tokens and lint, whichever comes first
    (`LayoutShare`); it carries its ticket's `Dispatch` for the backend to fill in."""
    assert gw.salter is not None
    share = req.layout_share if req.layout_share is not None else LayoutShare()
    req = evolve(req, upstream_salt=gw.salter.salt(req.namespace), layout_share=share,
                 dispatch=ticket.dispatch)
    return gw.preparing.prepare(req) if gw.preparing is not None else req


def _lint(gw: Gateway, body: dict[str, Any], req: ChatRequest, ticket: Ticket, mode: Any
          ) -> ChatRequest:
    """`req` with its lint findings and family (re-parsed when rewrite mode changed the body);
    the findings counted in the metrics."""
    outcome = gw.lint.run(body, ticket.route.provider, ticket.tenant, mode, req.layout_share)
    if outcome.changed:
        parse = ticket.route.reparse or ticket.route.parse
        req = evolve(parse(outcome.body, gw.parse_context(ticket.request_id, ticket.tenant)),
                     anthropic_beta=req.anthropic_beta, client_body=req.client_body)
    for rule in outcome.lint_ids:
        gw.metrics.lint_findings.inc(rule=rule)
    return evolve(req, lint_ids=outcome.lint_ids, family=outcome.family)


def _parse(config: GatewayConfig, ticket: Ticket, raw: bytes, ctx: ParseContext
           ) -> tuple[dict[str, Any], ChatRequest]:
    """The body to lint (max_tokens capped; a translated body's: the Responses route's chat
    body) and the validated request."""
    body = cap_max_tokens(parse_body(raw, config.max_json_depth), config.max_tokens_cap)
    ticket.body = body
    req = ticket.route.parse(body, ctx)  # validate what the client sent
    ticket.req = req
    return req.body, req


def _lint_fits(config: GatewayConfig, body: dict[str, Any], size: int) -> bool:
    """Lint work is bounded per request: larger bodies are served unlinted. An image's or a
    file's inline data is not lint's work (it lays each out as a digest: prompt_lint.media),
    so it does not count: a conversation's screenshots do not stop its rewriting."""
    messages = body.get("messages")
    count = len(messages) if isinstance(messages, list) else 0
    if size > config.lint_max_bytes and isinstance(messages, list):
        size -= media_chars(messages)
    if size <= config.lint_max_bytes and count <= config.lint_max_messages:
        return True
    log.info("body of %d bytes / %d messages is over the lint budget; not linted", size, count)
    return False
