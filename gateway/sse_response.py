"""A streamed response: SSE chunks in the route's format, an error event after the first chunk,
and the request's record written however the stream ends (finished, failed, or abandoned)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import Response, StreamingResponse

from gateway import render_anthropic, render_openai
from gateway.errors import error_body
from gateway.request_record import record
from gateway.request_state import CLIENT_CLOSED, Chunks, Gateway, Ticket
from gateway.types import ApiError, BackendError, ChatRequest, Final, TextDelta
from gateway.usage_report import prefixgate_headers

log = logging.getLogger("prefixgate.gateway")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def close_stream(stream: AsyncIterator[TextDelta | Final]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001 - closing must not mask the real outcome
            log.exception("closing a backend stream failed")


def streaming_response(
    gw: Gateway, ticket: Ticket, req: ChatRequest,
    first: TextDelta | Final, stream: AsyncIterator[TextDelta | Final],
) -> Response:
    early = first.usage if isinstance(first, Final) else first.usage
    chunks, head = ticket.route.stream_start(req, early)
    headers = {**prefixgate_headers(early, req.lint_ids, ticket.request_id), **SSE_HEADERS}
    body = _sse_body(gw, ticket, chunks, head, first, stream)

    async def cleanup() -> None:  # runs even when the body was never iterated
        record(gw, ticket, CLIENT_CLOSED, None, error="client disconnected")
        await close_stream(stream)

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
        yield stream_error(ticket, BackendError(502, error))
    except ApiError as err:
        status, error = err.status, err.message
        yield stream_error(ticket, err)
    except Exception as exc:  # noqa: BLE001
        internal = internal_error(exc)
        status, error = internal.status, internal.message
        yield stream_error(ticket, internal)
    finally:
        record(gw, ticket, status, final, error=error)
        with anyio.CancelScope(shield=True):
            await close_stream(stream)


def internal_error(exc: BaseException) -> BackendError:
    log.exception("request failed inside the gateway", exc_info=exc)
    return BackendError(500, f"internal gateway error: {type(exc).__name__}")


def stream_error(ticket: Ticket, err: ApiError) -> bytes:
    body = error_body(err, ticket.route.provider)
    if ticket.route.provider == "anthropic":
        return render_anthropic.error_event(body)
    return render_openai.error_event(body)
