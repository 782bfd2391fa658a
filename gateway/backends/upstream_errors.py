"""Upstream failures as the client's errors: every failure talking to an upstream becomes a
`BackendError` whose `kind` says what went wrong (`upstream_timeout`, `upstream_unavailable`,
`upstream_error`, `upstream_stream_cut`, an overload, or the upstream's own 4xx passed through,
with the provider's code and param). `is_replica_fault` tells the pool which of them take a
replica out of routing, `fails_over` which of them may send the request to another replica (not
an `AnswerTimeout`: that replica took the request, which would run, and be billed, twice). No
message names the replica or carries a credential: the error's `replica` does, for the record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import orjson

from gateway.types import BackendError

# an overloaded provider (Anthropic's 529 `overloaded_error`) is a fault too: the replica is
# backed off and the request tried on another, as for any answer the provider could not give
REPLICA_FAULT_KINDS = frozenset(
    {"upstream_timeout", "upstream_unavailable", "upstream_error", "upstream_stream_cut",
     "overloaded_error"}
)
#: Anthropic's status for "overloaded" (its `overloaded_error`)
OVERLOADED = 529


class AnswerTimeout(BackendError):
    """The upstream timed out waiting for the answer to a request it was sent whole (httpx's
    `ReadTimeout`): the replica may be running it, so it is never sent to another one."""


def transport_error(exc: httpx.HTTPError, replica: str, *, started: bool) -> BackendError:
    """Map an httpx exception to a client-facing error (no URL secrets, no headers)."""
    if isinstance(exc, httpx.ReadTimeout):
        return AnswerTimeout(504, "upstream timed out", kind="upstream_timeout",
                             replica=replica)
    if isinstance(exc, httpx.TimeoutException):  # connecting, a free connection: not sent
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


def status_error(status: int, body: bytes, replica: str,
                 headers: Mapping[str, str] | None = None) -> BackendError:
    """Map a non-2xx upstream answer to the error the client should see, with the provider's
    `retry-after` (whole seconds) passed on, so a client's SDK backs off as the provider asked;
    a refusal's or a server error's wait in any form (`provider_wait`) is the error's `wait_s`,
    how long the pool keeps the replica out of routing."""
    err = _status_error(status, body, replica)
    retry_after = headers.get("retry-after") if headers is not None else None
    if retry_after is not None and retry_after.strip().isdigit():
        err.retry_after = int(retry_after)
    if headers is not None and (status == 429 or status >= 500):
        err.wait_s = provider_wait(headers)
    return err


def provider_wait(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The seconds a provider asked to wait before its next request: OpenAI's `retry-after-ms`
    (the more precise), else `retry-after` in seconds or as an HTTP date (`now`: the wall
    clock, time.time()); None when it asked for none, or in no form that can be read."""
    millis = _seconds(headers.get("retry-after-ms"))
    if millis is not None:
        return millis / 1000
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _seconds(value)
    if seconds is not None:
        return seconds
    try:
        due = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    wait = due - (time.time() if now is None else now)
    return wait if wait > 0 else None


def _seconds(value: str | None) -> float | None:
    """A header's non-negative number (a count of seconds or ms), else None."""
    try:
        number = float(value) if value is not None else -1.0
    except ValueError:
        return None
    return number if 0 <= number < float("inf") else None


def _status_error(status: int, body: bytes, replica: str) -> BackendError:
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    return _refusal(status, payload, replica)


def _refusal(status: int, payload: Any, replica: str) -> BackendError:
    """The error for an upstream's HTTP status and its decoded error body."""
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
    """True for errors that say the replica cannot serve now (not the request's fault): it is
    unhealthy, or its provider refused with a wait (a 429 with `retry-after`: the replica is
    kept out of routing that long and the request, which ran nowhere, goes to another)."""
    return err.kind in REPLICA_FAULT_KINDS or (err.status == 429 and err.wait_s is not None)


def fails_over(err: BackendError) -> bool:
    """True for a replica's fault that may send the request to another replica: not one
    whose replica took it and timed out on its answer (`AnswerTimeout`)."""
    return is_replica_fault(err) and not isinstance(err, AnswerTimeout)


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


#: the HTTP status of each error type of Anthropic's API (its error objects name the type only
#: when they come inside a 200: a stream's `error` event, or a whole body)
ANTHROPIC_ERROR_STATUS = {
    "invalid_request_error": 400, "authentication_error": 401, "billing_error": 402,
    "permission_error": 403, "not_found_error": 404, "request_too_large": 413,
    "rate_limit_error": 429, "api_error": 500, "timeout_error": 504, "overloaded_error": OVERLOADED,
}


def error_object(payload: dict[str, Any], replica: str) -> BackendError:
    """An Anthropic error object (`{"type": "error", "error": {"type", "message"}}`) sent
    inside a 200, as a whole body or a stream's `error` event: a refusal's type is the error its
    HTTP status would be (`status_error`: a 429 a rate limit, a 404 a 404, with the provider's
    message); a server's, or a type not known, is `stream_error_event`'s 502 (overload its 529)."""
    status = ANTHROPIC_ERROR_STATUS.get(_error_type(payload) or "", 500)
    if status >= 500:
        return stream_error_event(payload, replica)
    return _refusal(status, payload, replica)


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
