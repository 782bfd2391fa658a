"""POST /v1/messages/count_tokens and /v1/responses/input_tokens: a request's prompt size,
before it is sent.

Anthropic clients ask it ahead of a request (Claude Code at start-up and to decide when to
compact its context); without the route they fail on a 404 or fall back to guesses. The body is
validated as a Messages request (without `max_tokens`); the answer is `{"input_tokens": N}`:
- the embedded engine: exact, the prompt's ids through the model's chat template and tools
  (what a Messages request with the same body prefills);
- an Anthropic upstream: the upstream's own count (the request passed on);
- any other upstream: prefixgate's own count (prompt_lint's token layout, tiktoken's
  cl100k_base), marked `x-prefixgate-usage: estimated`.
Errors are Anthropic-shaped. `/v1/responses/input_tokens` (the openai SDK's
`responses.input_tokens.count`) counts a Responses body the same way (validated as
`/v1/responses` validates it; an Anthropic upstream's count is prefixgate's own there) and
answers `{"object": "response.input_tokens", "input_tokens": N}`, errors OpenAI-shaped.
No stats record is written: nothing is generated. A count is a
request like any other for admission: the tenant's rate and concurrency limits and the
gateway's slots apply (a 429 / 503 with `retry-after`), so counting is no way around them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from gateway.admission import Overloaded
from gateway.body import parse_body, text_chars
from gateway.errors import error_body
from gateway.overlap import cpu_work
from gateway.parse_anthropic import parse_messages
from gateway.parse_responses import parse_responses
from gateway.pipeline import read_body, with_beta
from gateway.request_state import CLIENT_CLOSED, Gateway, new_request_id
from gateway.shadow import prompt_tokens
from gateway.types import (
    ApiError,
    BackendError,
    ChatRequest,
    CountingBackend,
    Provider,
    TokenCount,
)


def _messages_request(gw: Gateway, request: Request, tenant: str, raw: bytes) -> ChatRequest:
    """The body validated as a Messages request."""
    body = parse_body(raw, gw.config.max_json_depth)
    ctx = gw.parse_context(new_request_id(), tenant)
    return with_beta(request, parse_messages({**body, "max_tokens": 1, "stream": False}, ctx))


def _responses_request(gw: Gateway, request: Request, tenant: str, raw: bytes) -> ChatRequest:
    """The body validated as a Responses request (`personality`, a field of the count only,
    left out)."""
    body = parse_body(raw, gw.config.max_json_depth)
    body.pop("personality", None)
    ctx = gw.parse_context(new_request_id(), tenant)
    return parse_responses({**body, "stream": False}, ctx)


async def _count(gw: Gateway, req: ChatRequest) -> TokenCount:
    """`req`'s prompt counted by the backend (or estimated)."""
    if isinstance(gw.backend, CountingBackend):
        return await gw.backend.count_tokens(req)
    return await estimate(req, gw.config.inline_prepare_bytes)


async def estimate(req: ChatRequest, inline_bytes: int) -> TokenCount:
    """prefixgate's own count of `req`'s prompt (under prompt_lint's lock: inline for a small
    body, else in a worker thread; gateway.overlap)."""
    size = text_chars(req.messages, req.prompt)
    return TokenCount(len(await cpu_work(size, inline_bytes, prompt_tokens, req)), estimated=True)


async def count_tokens(request: Request) -> Response:
    """`/v1/messages/count_tokens`: `{"input_tokens": N}`, errors in Anthropic's shape."""
    return await _serve(request, _messages_request, "anthropic", {})


async def input_tokens(request: Request) -> Response:
    """`/v1/responses/input_tokens`: `{"object": "response.input_tokens", "input_tokens": N}`,
    errors in OpenAI's shape."""
    return await _serve(request, _responses_request, "openai",
                        {"object": "response.input_tokens"})


async def _serve(request: Request, parse: Callable[[Gateway, Request, str, bytes], ChatRequest],
                 provider: Provider, answer: dict[str, Any]) -> Response:
    """Validate, admit, count through the backend, answer (`answer` plus the count)."""
    gw: Gateway = request.app.state.gateway
    assert gw.admission is not None
    try:
        tenant = gw.auth.tenant(request)
        with gw.admission.reading_body(tenant):
            raw = await read_body(request, gw.config.max_body_bytes)
        slot = await gw.admission.acquire(tenant)
        try:
            count = await _count(gw, parse(gw, request, tenant, raw))
        finally:
            slot.release()
    except ApiError as err:
        retry_after = err.retry_after if isinstance(err, BackendError | Overloaded) else None
        headers = {"retry-after": str(retry_after)} if retry_after is not None else None
        return JSONResponse(error_body(err, provider), status_code=err.status,
                            headers=headers)
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    usage = "estimated" if count.estimated else "reported"
    return JSONResponse({**answer, "input_tokens": count.input_tokens},
                        headers={"x-prefixgate-usage": usage})
