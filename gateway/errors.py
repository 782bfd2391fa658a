"""Client-facing errors, rendered in the client's own format.

OpenAI: `{"error": {"message", "type", "param", "code"}}`; `type` is OpenAI's error class for
the status (a 404 is an `invalid_request_error`, as OpenAI's own: an unknown model's `code` is
`model_not_found`), `code` the error's own kind when that says more than its type (an
upstream's refusal: the provider's own code).
Anthropic: `{"type": "error", "error": {"type", "message"}}` (the field is named in the message;
a 404 is a `not_found_error`).
"""

from __future__ import annotations

from typing import Any

from gateway.types import ApiError, Provider

OPENAI_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class GatewayError(ApiError):
    """A request the gateway refuses or fails; `param` names the offending field."""


def invalid(message: str, param: str | None = None, *, status: int = 400) -> GatewayError:
    """A 4xx for a bad field."""
    return GatewayError(status, message, kind="invalid_request_error", param=param)


def model_not_found(message: str) -> GatewayError:
    """The 404 for a model the gateway does not serve (OpenAI's code: `model_not_found`)."""
    return GatewayError(404, message, kind="model_not_found", param="model")


def client_status(err: ApiError, provider: Provider) -> int:
    """The HTTP status `provider`'s client gets for `err`: its own, except that an upstream's
    529 (Anthropic's `overloaded_error`, which only Anthropic's API and SDK know) is an OpenAI
    client's 503. 503, not 429: OpenAI's API says "overloaded" with a 503, and its SDK retries
    it as a server's fault; a 429 says the caller's own rate limit or quota is spent, which an
    agent may act on (stop, switch keys) when the provider is merely busy. The gateway's own
    full queue is a 503 as well."""
    if err.status == 529 and provider != "anthropic":
        return 503
    return err.status


def error_type(status: int, provider: Provider) -> str:
    """The provider's error type for an HTTP status."""
    table = ANTHROPIC_TYPES if provider == "anthropic" else OPENAI_TYPES
    return table.get(status, "api_error" if status >= 500 else "invalid_request_error")


# an Anthropic error type that says more than the status (a full queue's 503 is Anthropic's
# overloaded_error, not an api_error)
ANTHROPIC_KINDS = frozenset({"overloaded_error", "rate_limit_error"})


def error_body(err: ApiError, provider: Provider) -> dict[str, Any]:
    """The JSON error body in the client's format."""
    kind = error_type(client_status(err, provider), provider)
    if provider == "anthropic":
        kind = err.kind if err.kind in ANTHROPIC_KINDS else kind
        message = err.message
        if err.param and err.param not in message:
            message = f"{err.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}
    code = err.code or (err.kind if err.kind not in {kind, "api_error"} else None)
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": code}}
