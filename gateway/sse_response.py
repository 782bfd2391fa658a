"""A streamed response: SSE chunks in the route's format, an error event after the first chunk,
and the request's record written however the stream ends (finished, failed, or abandoned),
once its last byte is sent: the backend stream is closed and the record written after it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response

from gateway import render_anthropic, render_openai
from gateway.errors import client_status, error_body
from gateway.request_record import record
from gateway.request_state import CLIENT_CLOSED, Chunks, Gateway, Ticket
from gateway.responses import FinishingStream
from gateway.types import ApiError, BackendError, ChatRequest, Final, Provider, TextDelta
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
    outcome = _Outcome()
    body = _sse_body(ticket, chunks, head, first, stream, outcome)

    async def cleanup() -> None:  # after the last byte, and even when the body never ran
        record(gw, ticket, outcome.status, outcome.final,
               error=outcome.error_if(cancelled=response.cancelled), replica=outcome.replica)
        await close_stream(stream)

    response = FinishingStream(body, cleanup, media_type="text/event-stream", headers=headers)
    return response


@dataclass
class _Outcome:
    """How a stream ended, for its record (written once the last byte is sent)."""

    status: int = CLIENT_CLOSED
    final: Final | None = None
    error: str | None = "client disconnected"
    replica: str | None = None  # the one that failed the stream

    def error_if(self, *, cancelled: bool) -> str | None:
        """The record's error: a stream that ended neither finished nor failed was cut by
        the server ("cancelled", as a whole answer's record says) when `cancelled`, else its
        client left."""
        if cancelled and self.final is None and self.status == CLIENT_CLOSED:
            return "cancelled"
        return self.error

    def failed(self, err: ApiError, provider: Provider) -> None:
        self.status, self.error = client_status(err, provider), err.message
        self.replica = err.replica if isinstance(err, BackendError) else None


async def _sse_body(
    ticket: Ticket, chunks: Chunks, head: bytes, first: TextDelta | Final,
    stream: AsyncIterator[TextDelta | Final], outcome: _Outcome,
) -> AsyncIterator[bytes]:
    err: ApiError
    try:
        if head:
            yield head
        item = first
        while True:
            if isinstance(item, Final):
                outcome.status, outcome.final, outcome.error = 200, item, None
                yield chunks.final(item)
                return
            ticket.progress.see(item)
            piece = chunks.delta(item)
            if piece:
                yield piece
            item = await anext(stream)
    except StopAsyncIteration:
        err = BackendError(502, "backend ended without a result")
    except ApiError as exc:
        err = exc
    except Exception as exc:  # noqa: BLE001
        err = internal_error(exc)
    outcome.failed(err, ticket.route.provider)
    failed = getattr(chunks, "failed", None)  # a route with its own failure event (Responses)
    yield failed(err, outcome.status) if failed is not None else stream_error(ticket, err)


def internal_error(exc: BaseException) -> BackendError:
    log.exception("request failed inside the gateway", exc_info=exc)
    return BackendError(500, f"internal gateway error: {type(exc).__name__}")


def stream_error(ticket: Ticket, err: ApiError) -> bytes:
    body = error_body(err, ticket.route.provider)
    if ticket.route.provider == "anthropic":
        return render_anthropic.error_event(body)
    return render_openai.error_event(body)
