"""POST /v1/messages/count_tokens (gateway.count_tokens) through the official anthropic SDK.

References: what the same body then reports as its prompt size when it is sent to
/v1/messages (the count an agent takes before a request must be the one it pays after), and
what an Anthropic upstream receives and answers (the request passed on, its count returned).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from .gateway_fakes import FAKE_MODEL
from .upstream_helpers import gateway_app, pool_over_handler, records

SYSTEM = "You are the release agent of the payments team. Check every change twice. " * 12
TOOLS = [{"name": "read_file", "description": "read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
MESSAGES = [{"role": "user", "content": "Which files changed in the last release?"}]


def sdk(app: Any, key: str = "none") -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway")
    return anthropic.AsyncAnthropic(base_url="http://gateway", api_key=key, http_client=http,
                                    max_retries=0)


def openai_answer_without_usage(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={
        "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"},
                     "finish_reason": "stop"}]})


async def test_an_upstream_without_the_endpoint_gets_the_count_it_will_record(tmp_path: Path):
    """An OpenAI-compatible upstream has no count endpoint: prefixgate's own count, marked
    estimated, is the one the same request then carries (and is recorded with) when the
    upstream reports no usage."""
    app = gateway_app(tmp_path, pool_over_handler(openai_answer_without_usage))
    client = sdk(app)
    short = await client.messages.with_raw_response.count_tokens(model="m", messages=MESSAGES)
    assert short.headers["x-prefixgate-usage"] == "estimated"
    full = await client.messages.count_tokens(model="m", system=SYSTEM, tools=TOOLS,
                                              messages=MESSAGES)
    sent = await client.messages.create(model="m", max_tokens=8, system=SYSTEM, tools=TOOLS,
                                        messages=MESSAGES)
    assert full.input_tokens == sent.usage.input_tokens > (await short.parse()).input_tokens > 0
    assert [(r.prompt_tokens, r.usage_estimated) for r in records(app)] == [
        (full.input_tokens, True)]  # counting writes no record; the request one


async def test_an_anthropic_upstream_counts_what_it_is_passed(tmp_path: Path):
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if body["messages"][0]["content"] == "refuse":
            return httpx.Response(400, json={"type": "error", "error": {
                "type": "invalid_request_error", "message": "messages: bad block"}})
        return httpx.Response(200, json={"input_tokens": 1234})

    pool = pool_over_handler(upstream, kind="anthropic", url="http://up.test",
                             api_key="sk-upstream")
    app = gateway_app(tmp_path, pool)
    client = sdk(app)
    raw = await client.messages.with_raw_response.count_tokens(
        model="claude-x", system=SYSTEM, tools=TOOLS, messages=MESSAGES)
    assert (await raw.parse()).input_tokens == 1234
    assert raw.headers["x-prefixgate-usage"] == "reported"
    request = seen[-1]
    assert request.url == "http://up.test/v1/messages/count_tokens"
    assert request.headers["x-api-key"] == "sk-upstream"
    assert json.loads(request.content) == {"model": "claude-x", "system": SYSTEM, "tools": TOOLS,
                                           "messages": MESSAGES}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.count_tokens(model="claude-x",
                                           messages=[{"role": "user", "content": "refuse"}])
    assert "bad block" in refused.value.message
    assert records(app) == []


async def test_bad_requests_are_anthropic_errors(make_fake_app):
    app = make_fake_app(api_keys={"k1": "alpha"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        url = "/v1/messages/count_tokens"
        missing = await http.post(url, json={"model": FAKE_MODEL}, headers={"x-api-key": "k1"})
        wrong_key = await http.post(url, json={"messages": MESSAGES}, headers={"x-api-key": "no"})
        bad_json = await http.post(url, content=b"{", headers={"x-api-key": "k1"})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
    assert wrong_key.status_code == 401
    assert bad_json.status_code == 400
    for response in (missing, wrong_key, bad_json):
        assert response.json()["type"] == "error"


async def test_counting_is_admitted_like_any_request(make_fake_app):
    """A tenant over its rate gets a 429 from the count route as from /v1/messages (one
    bucket for both), with `retry-after`; another tenant is not held back."""
    app = make_fake_app(api_keys={"k1": "alpha", "k2": "beta"}, tenant_rate_per_s=0.01,
                        tenant_burst=2)
    alpha, beta = sdk(app, "k1"), sdk(app, "k2")
    for _ in range(2):
        counted = await alpha.messages.count_tokens(model=FAKE_MODEL, messages=MESSAGES)
        assert counted.input_tokens > 0
    with pytest.raises(anthropic.RateLimitError) as refused:
        await alpha.messages.count_tokens(model=FAKE_MODEL, messages=MESSAGES)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    with pytest.raises(anthropic.RateLimitError):
        await alpha.messages.create(model=FAKE_MODEL, max_tokens=8, messages=MESSAGES)
    assert (await beta.messages.count_tokens(model=FAKE_MODEL, messages=MESSAGES)).input_tokens
    admission = app.state.gateway.admission
    assert (admission.running, admission.queued) == (0, 0)  # every slot given back


async def test_unknown_endpoints_answer_in_the_callers_format(make_fake_app):
    """An endpoint prefixgate does not serve is a JSON error an SDK can read (it was
    Starlette's plain text); the dashboard keeps its own."""
    app = make_fake_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        embeddings = await http.post("/v1/embeddings", json={"input": "x"})
        batches = await http.post("/v1/messages/batches", json={})
        wrong_verb = await http.get("/v1/chat/completions")
        page = await http.get("/dashboard/nowhere")
    assert embeddings.status_code == 404  # OpenAI's own unknown-URL answer: no not_found type
    assert embeddings.json()["error"]["type"] == "invalid_request_error"
    assert embeddings.json()["error"]["code"] is None
    assert "/v1/embeddings" in embeddings.json()["error"]["message"]
    assert batches.status_code == 404 and batches.json()["type"] == "error"
    assert batches.json()["error"]["type"] == "not_found_error"
    assert wrong_verb.status_code == 405 and "allow" in wrong_verb.headers
    assert wrong_verb.json()["error"]["type"] == "invalid_request_error"
    assert page.status_code == 404 and page.text == "Not Found"


def _without(app: Any, paths: set[str]) -> Any:
    """`app` answering 404 on `paths` (a server build without those endpoints)."""
    async def served(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in paths:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        await app(scope, receive, send)
    return served


def _llama(**config: Any) -> Any:
    from gateway.fake_llama_server import FakeLlamaConfig, create_fake_llama_server
    return create_fake_llama_server(FakeLlamaConfig(**config))


def _openai_compatible(server: str) -> Any:
    from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream
    return create_fake_upstream(FakeUpstreamConfig(server=server))


@pytest.mark.parametrize(("kind", "make", "exact"), [
    ("llamacpp", _llama, True),
    ("auto", _llama, True),  # detected from /v1/models and /props, then counted the same way
    ("vllm", lambda: _openai_compatible("vllm"), True),
    ("auto", lambda: _openai_compatible("vllm"), True),
    ("sglang", lambda: _openai_compatible("sglang"), False),  # no tokenizer endpoint: estimated
    ("llamacpp", lambda: _without(_llama(), {"/apply-template"}), False),  # an older build
])
async def test_servers_with_a_tokenizer_count_what_they_will_report(
        tmp_path: Path, kind: str, make: Any, exact: bool):
    """Reference: the prompt size the same server reports when the same Messages body is then
    sent (its own tokenizer over its own rendering of the body, tools included). Where the
    server has no way to count, prefixgate's own count comes back, marked estimated."""
    from .upstream_helpers import pool_over
    app = gateway_app(tmp_path, pool_over([make()], kind=kind))
    client = sdk(app)
    raw = await client.messages.with_raw_response.count_tokens(
        model="fake", system=SYSTEM, tools=TOOLS, messages=MESSAGES)
    counted = (await raw.parse()).input_tokens
    sent = await client.messages.create(model="fake", max_tokens=8, system=SYSTEM, tools=TOOLS,
                                        messages=MESSAGES)
    assert raw.headers["x-prefixgate-usage"] == ("reported" if exact else "estimated")
    assert (counted == sent.usage.input_tokens) is exact
    assert [r.prompt_tokens for r in records(app)] == [sent.usage.input_tokens]
