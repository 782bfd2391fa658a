"""A request's answer on its way out: the whole answer as JSON, a stream's response, an error in
the client's format, and the watch for a client that leaves while the answer is made. Each
leaves the request's one record: a whole answer's once it is on its way (`FinishingJSON`), an
error's at once, a stream's after its last byte (gateway.sse_response)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Overloaded
from gateway.errors import client_status, error_body
from gateway.request_record import record
from gateway.request_state import CLIENT_CLOSED, Gateway, Ticket
from gateway.responses import FinishingJSON
from gateway.sse_response import close_stream, internal_error, streaming_response
from gateway.types import ApiError, BackendError, ChatRequest, Final, TextDelta
from gateway.usage_report import SUMMARY_FIELD, prefixgate_headers, summary


async def first_item(stream: AsyncIterator[TextDelta | Final]) -> TextDelta | Final:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise BackendError(502, "backend returned no output") from None


async def stream_response(
    gw: Gateway, ticket: Ticket, req: ChatRequest,
    first: TextDelta | Final, stream: AsyncIterator[TextDelta | Final],
) -> Response:
    """The streamed answer; a failure to render its head is a 500 like any other (the
    backend stream closed, the slot given back with the one record)."""
    try:
        return streaming_response(gw, ticket, req, first, stream)
    except Exception as exc:  # noqa: BLE001 - a renderer bug must not leak the request
        await close_stream(stream)
        return error_response(gw, ticket, internal_error(exc))


def error_response(gw: Gateway, ticket: Ticket, err: ApiError) -> Response:
    """The error in the caller's format, with a `retry-after` when the refusal (the gateway's
    admission, or the provider's) says when to come back; its record names the replica."""
    if ticket.route.client_error is not None:
        err = ticket.route.client_error(err, ticket.req)
    replica = err.replica if isinstance(err, BackendError) else None
    status = client_status(err, ticket.route.provider)
    record(gw, ticket, status, None, error=err.message, replica=replica)
    lint_ids = ticket.req.lint_ids if ticket.req else ()
    headers = prefixgate_headers(None, lint_ids, ticket.request_id)
    retry_after = err.retry_after if isinstance(err, BackendError | Overloaded) else None
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    body = error_body(err, ticket.route.provider)
    return JSONResponse(body, status_code=status, headers=headers)


async def json_response(
    gw: Gateway, request: Request, ticket: Ticket, req: ChatRequest,
    first: TextDelta | Final, stream: AsyncIterator[TextDelta | Final],
) -> Response:
    """The whole answer as JSON; the backend stream is closed and the record written once the
    response is on its way (or its send failed), off the path to the client."""
    try:
        final = await until_final(request, ticket, first, stream)
    except ApiError as err:
        return error_response(gw, ticket, err)
    except Exception as exc:  # noqa: BLE001
        return error_response(gw, ticket, internal_error(exc))
    except BaseException:  # cancelled (server shutdown): still one record
        record(gw, ticket, CLIENT_CLOSED, None, error="cancelled")
        raise
    if final is None:
        record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected")
        return Response(status_code=CLIENT_CLOSED)

    async def finish() -> None:
        await close_stream(stream)
        record(gw, ticket, 200, final)

    try:
        body = ticket.route.render(req, final, int(time.time()))
        body[SUMMARY_FIELD] = summary(final.usage)
        headers = prefixgate_headers(final.usage, req.lint_ids, ticket.request_id)
        return FinishingJSON(body, finish, headers=headers)
    except Exception as exc:  # noqa: BLE001
        await close_stream(stream)
        return error_response(gw, ticket, internal_error(exc))


async def until_final(
    request: Request, ticket: Ticket, first: TextDelta | Final,
    stream: AsyncIterator[TextDelta | Final],
) -> Final | None:
    """Drain the stream to its Final; None when the client disconnected first (the backend
    stream is then cancelled, which aborts the engine request). The stream is closed here
    unless its Final came back (the caller closes it after answering)."""
    if isinstance(first, Final):  # a non-streaming upstream: the answer is already here
        return first

    async def drain() -> Final:
        item: TextDelta | Final = first
        while not isinstance(item, Final):
            ticket.progress.see(item)  # the record of a request cut short counts it
            item = await stream.__anext__()
        return item

    task = asyncio.ensure_future(drain())
    watcher: asyncio.Future[Any] = asyncio.ensure_future(wait_disconnect(request))
    final: Final | None = None
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        final = task.result()
        return final
    except StopAsyncIteration:
        raise BackendError(502, "backend ended without a result") from None
    finally:
        watcher.cancel()
        if not task.done():  # this task was cancelled (a shutdown): the drain ends first,
            task.cancel()  # else closing the stream it is reading fails ("already running")
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if final is None:
            await close_stream(stream)


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
