"""Anthropic upstream: answers in unusual shapes. An error object sent as a 200's body or as a
stream's `error` event, and a whole answer to a streamed request (a server that ignores
`"stream": true`), with thinking blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from .upstream_helpers import gateway_app, pool_over_handler, records

# the error type Anthropic sends, and what each client gets for it (the status and type its
# own API would answer with; an OpenAI client's 503 for "overloaded", as its API says it)
ERRORS = [
    ("overloaded_error", (529, "overloaded_error"), (503, "api_error")),
    ("rate_limit_error", (429, "rate_limit_error"), (429, "rate_limit_error")),
    ("invalid_request_error", (400, "invalid_request_error"), (400, "invalid_request_error")),
    ("not_found_error", (404, "not_found_error"), (404, "invalid_request_error")),
    ("api_error", (502, "api_error"), (502, "api_error")),
]
MESSAGE = "The service is busy right now (req_011)."


def _error_answer(kind: str, shape: str) -> Any:
    """An Anthropic upstream answering 200 with an error object: as the whole JSON body
    ("body"), or as the `error` event of a stream begun with message_start ("event")."""
    error = {"type": "error", "error": {"type": kind, "message": MESSAGE}}

    def handler(request: httpx.Request) -> httpx.Response:
        if shape == "body":
            return httpx.Response(200, json=error)
        start = {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "model": "claude-test", "usage": {"input_tokens": 5, "output_tokens": 1}}}
        events = [("message_start", start), ("error", error)]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content="".join(
            f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events).encode())
    return handler


@pytest.mark.parametrize(("kind", "anthropic_error", "openai_error"), ERRORS)
@pytest.mark.parametrize(("shape", "stream"), [("body", False), ("body", True),
                                               ("event", True)])
async def test_an_error_object_in_a_200_is_the_providers_error(
        tmp_path: Path, kind: str, anthropic_error: tuple[int, str],
        openai_error: tuple[int, str], shape: str, stream: bool) -> None:
    """An Anthropic upstream's error object in a 200 (its whole body, or a stream's error event
    before any content) reaches either client as the error that type is: its status and type,
    the provider's message; never "sent no content"."""
    pool = pool_over_handler(_error_answer(kind, shape), kind="anthropic",
                             url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        anth = await client.post("/v1/messages", json={
            "model": "claude-test", "max_tokens": 9, "stream": stream,
            "messages": [{"role": "user", "content": "go"}]})
        pool.router.replicas[0].mark_ok()  # a fault's back-off must not hide the next answer
        chat = await client.post("/v1/chat/completions", json={
            "model": "claude-test", "stream": stream,
            "messages": [{"role": "user", "content": "go"}]})
    assert (anth.status_code, anth.json()["error"]["type"]) == anthropic_error
    assert anth.json()["type"] == "error" and MESSAGE in anth.json()["error"]["message"]
    assert (chat.status_code, chat.json()["error"]["type"]) == openai_error
    assert MESSAGE in chat.json()["error"]["message"]
    assert [row.status for row in records(app)] == [anthropic_error[0], openai_error[0]]
    app.state.store.close()
    await pool.aclose()


SIGNATURE = "EqQBCgIYAhIM1gbcDa9GJwZA2b3h+/=\u00e9sig456"
CITATION = {"type": "char_location", "cited_text": "Ship on Fridays.", "document_index": 0,
            "document_title": "policy", "start_char_index": 0, "end_char_index": 16}
REPLY = [  # every kind of block an answer with thinking, citations and a tool call has
    {"type": "thinking", "thinking": "Check the policy, then read setup.py.",
     "signature": SIGNATURE},
    {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
    {"type": "text", "text": "According to the policy, "},
    {"type": "text", "text": "releases ship on Fridays", "citations": [CITATION]},
    {"type": "text", "text": ". Reading setup.py."},
    {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "setup.py"}},
]


def ignores_stream(request: httpx.Request) -> httpx.Response:
    """An Anthropic-compatible server that ignores `"stream": true`: every answer is one whole
    Messages body."""
    return httpx.Response(200, json={
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": REPLY, "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 30, "output_tokens": 12}})


async def test_a_whole_answer_streamed_keeps_its_thinking_and_cited_blocks(
        tmp_path: Path) -> None:
    """A whole answer to a streamed request reaches an Anthropic client streaming as the same
    content blocks the upstream sent and a whole request gets: thinking with its signature,
    redacted thinking, cited text, text and tool_use, each in its place (the SDK's own stream
    accumulation is the reader)."""
    pool = pool_over_handler(ignores_stream, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    client = _sdk(app)
    ask: dict[str, Any] = {
        "model": "claude-test", "max_tokens": 4096,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "When do releases ship? Then open setup.py."}],
        "tools": [{"name": "read_file", "description": "read a file", "input_schema": {
            "type": "object", "properties": {"path": {"type": "string"}}}}]}
    whole = await client.messages.create(**ask)
    async with client.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in whole.content] == REPLY
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == REPLY
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert [r.status for r in records(app)] == [200, 200]
    app.state.store.close()
    await pool.aclose()


def _sdk(app: Any) -> anthropic.AsyncAnthropic:
    """The official SDK as the client (it runs on httpx2: its in-process transport too)."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return anthropic.AsyncAnthropic(api_key="unused", base_url="http://gw", http_client=http,
                                    max_retries=0)


async def test_a_refused_answer_in_an_openai_history_reaches_anthropic_as_text(
        tmp_path: Path) -> None:
    """An OpenAI client's history holding a refused structured answer (`refusal` beside a null
    content, or a refusal part) goes to an Anthropic upstream as that assistant turn's text
    (before: a 400 for the client's own history)."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": "Blue."}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 20, "output_tokens": 2}})

    pool = pool_over_handler(handler, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    refusal = "I can't help with that request."
    turns = [{"role": "assistant", "content": None, "refusal": refusal},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": refusal}]}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        for turn in turns:
            answer = await client.post("/v1/chat/completions", json={
                "model": "claude-test", "messages": [
                    {"role": "user", "content": "Write it."}, turn,
                    {"role": "user", "content": "Then name a colour."}]})
            assert answer.status_code == 200, answer.text
    for body in sent:  # (the gateway's own cache breakpoint at the history's end aside)
        turn = body["messages"][1]
        assert turn["role"] == "assistant"
        assert [{k: v for k, v in block.items() if k != "cache_control"}
                for block in turn["content"]] == [{"type": "text", "text": refusal}]
    assert len(sent) == 2
    app.state.store.close()
    await pool.aclose()
