"""The one record of a request: its stats row (queued for the store's writer) and its metrics."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from gateway.request_state import Gateway, Ticket
from gateway.types import ChatRequest, Final, Usage
from gateway.validate import is_served
from prompt_lint.media import without_payloads


def record(
    gw: Gateway, ticket: Ticket, status: int, final: Final | None, *, error: str | None = None,
    replica: str | None = None,
) -> None:
    """Store the one record of this request and update the metrics; `replica`: the one that
    failed it, when no answer names one; else the one the backend sent it to (a request cut
    short is filed under the replica that had its work)."""
    if ticket.recorded:
        return
    ticket.recorded = True
    if ticket.slot is not None:
        ticket.slot.release()
    gw.metrics.in_flight.dec()
    gw.unrecorded -= 1
    latency = time.perf_counter() - ticket.started
    usage = final.settled_usage() if final else ticket.progress.usage()  # cut short: so far
    backend = gw.backend.name
    gw.metrics.requests.inc(route=ticket.route.name, status=str(status), backend=backend)
    gw.metrics.latency.observe(latency, route=ticket.route.name)
    if usage is not None:
        gw.metrics.observe_usage(usage, backend)
    replica = final.replica if final else (replica or ticket.dispatch.replica)
    gw.store.add(_make_record(gw, ticket, status, replica, usage, error, latency))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _make_record(
    gw: Gateway, ticket: Ticket, status: int, replica: str | None, usage: Usage | None,
    error: str | None, latency: float,
) -> dict[str, Any]:
    """The record's column values: a plain dict, so no ORM object is built on the request
    path (the store's writer thread inserts the rows in batches)."""
    req = ticket.req
    body = ticket.body or {}
    return dict(
        ts=datetime.now(UTC),
        request_id=ticket.request_id,
        tenant=ticket.tenant or "-",
        model=req.model if req else _served_model(gw, body),
        backend=gw.backend.name,
        replica=replica,
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


def _served_model(gw: Gateway, body: dict[str, Any]) -> str:
    """The model of a body that never became a request (rejected, or the client went away
    first) when it names a served model, else "": a client's typo or a non-string `model` is
    no model, and a stats row per such value would clutter the by-model tables."""
    model = body.get("model")
    return model[:256] if is_served(model, gw.backend.models()) else ""


def _prompt_text(gw: Gateway, req: ChatRequest | None) -> str | None:
    if not gw.config.store_prompts or req is None:
        return None
    if req.prompt is not None:
        return req.prompt
    # an image's or a file's inline data is stored as its digest (prompt_lint.media)
    messages = without_payloads(list(req.messages))
    return json.dumps({"messages": messages, "tools": req.tools}, ensure_ascii=False)
