"""POST /v1/responses over upstreams, through the official openai SDK's Responses client.

Independent references: the SDK's own models and its stream helper (`responses.stream`, whose
accumulation checks the event sequence: created first, items added before their content, every
item finished before `response.completed`); the chat body an upstream receives, written out by
hand; the fake replica's own cache (`gateway.fake_upstream`) replayed for the cached tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream

from .upstream_helpers import fake_replicas, gateway_app, pool_over, pool_over_handler

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather now.",
                     "parameters": WEATHER, "strict": True}]
#: a conversation with a finished tool round trip, as the Responses API holds it
HISTORY: list[Any] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city":"Paris"}', "status": "completed"},
    {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
]
#: the same conversation as a chat client sends it (instructions first)
CHAT_HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "user", "content": "And tomorrow?"},
]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now.", "parameters": WEATHER,
    "strict": True}}]
REPLY = "Done. The next step is ready. "  # the fake replica's answer, word by word


def sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://gw/v1", http_client=http,
                              max_retries=0)


async def test_the_upstream_gets_the_equivalent_chat_request(tmp_path: Path) -> None:
    """Instructions first as the system message; a function_call joins the assistant turn
    before it as its tool_calls, its output is the tool message; reasoning items dropped;
    function tools, tool_choice, max_output_tokens and text.format in chat's shape."""
    replicas = fake_replicas(1)
    pool = pool_over(replicas)
    app = gateway_app(tmp_path, pool)
    fmt = {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}
    answer = await sdk(app).responses.create(
        model="fake", instructions="You are terse.", input=HISTORY, tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=50,
        temperature=0.5, parallel_tool_calls=False, text={"format": fmt},
        metadata={"run": "7"}, store=False, truncation="disabled")
    body = replicas[0].state.replica.config.bodies[0]
    assert body["messages"] == CHAT_HISTORY
    assert body["tools"] == CHAT_TOOLS
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["max_completion_tokens"] == 50
    assert body["temperature"] == 0.5 and body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "forecast", "schema": WEATHER, "strict": True}}
    for field in ("input", "instructions", "text", "store", "truncation", "max_output_tokens"):
        assert field not in body
    assert answer.output_text == REPLY
    assert answer.status == "completed" and answer.id.startswith("resp_")
    # the echoed parameters are the client's own
    assert answer.instructions == "You are terse." and answer.max_output_tokens == 50
    assert answer.tools[0].name == "get_weather" and answer.temperature == 0.5
    assert answer.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    assert answer.text is not None and answer.text.format.type == "json_schema"
    assert answer.metadata == {"run": "7"} and answer.parallel_tool_calls is False
    app.state.store.close()
    await pool.aclose()


async def _replayed_cached_tokens(bodies: list[dict[str, Any]]) -> list[int]:
    """What a fresh fake replica reports for `bodies` sent to it directly, in order."""
    fresh = create_fake_upstream(FakeUpstreamConfig(name="ref"))
    out = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fresh),
                                 base_url="http://ref") as client:
        for body in bodies:
            answer = await client.post("/v1/chat/completions", json={**body, "stream": False})
            out.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return out


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_are_the_upstreams_own(tmp_path: Path, stream: bool) -> None:
    """A second turn on the same conversation reports the replica's cache hit as
    `usage.input_tokens_details.cached_tokens`, the `prefixgate` summary and the headers
    (whole answer, or the stream's `response.completed`)."""
    replicas = fake_replicas(1)
    pool = pool_over(replicas)
    app = gateway_app(tmp_path, pool)
    client = sdk(app)
    long_rules = "Rules: " + " ".join(f"rule {i} is to be followed." for i in range(80))
    usages, summaries = [], []
    for turn in ("First question?", "Second question?"):
        kwargs: dict[str, Any] = {"model": "fake", "instructions": long_rules, "input": turn}
        if stream:
            async with client.responses.stream(**kwargs) as events:
                last = [e async for e in events][-1]
                final = await events.get_final_response()
            assert last.type == "response.completed"
            assert final.output_text == REPLY
            usages.append(final.usage)
            summaries.append(final.model_extra["prefixgate"])  # type: ignore[index]
        else:
            raw = await client.responses.with_raw_response.create(**kwargs)
            answer = raw.parse()
            assert answer.output_text == REPLY
            assert raw.headers["x-prefixgate-cached-tokens"] == str(
                answer.usage.input_tokens_details.cached_tokens)  # type: ignore[union-attr]
            usages.append(answer.usage)
            summaries.append(answer.model_extra["prefixgate"])  # type: ignore[index]
    expected = await _replayed_cached_tokens(replicas[0].state.replica.config.bodies)
    assert expected[1] > 0
    assert [u.input_tokens_details.cached_tokens for u in usages] == expected
    assert [s["cached_tokens"] for s in summaries] == expected
    assert usages[1].total_tokens == usages[1].input_tokens + usages[1].output_tokens
    app.state.store.close()
    await pool.aclose()




async def test_an_anthropic_upstream_gets_a_messages_body(tmp_path: Path) -> None:
    """The same Responses conversation reaches an Anthropic upstream as a Messages body: the
    instructions as `system`, the call as a tool_use block, its output as a tool_result."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": "Cloudy."},
                        {"type": "tool_use", "id": "toolu_9", "name": "get_weather",
                         "input": {"city": "Lyon"}}],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 40, "output_tokens": 5, "cache_read_input_tokens": 32}})

    pool = pool_over_handler(handler, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    answer = await sdk(app).responses.create(model="claude-test", instructions="You are terse.",
                                             input=HISTORY, tools=TOOLS)
    body = sent[0]
    assert body["system"] in ("You are terse.", [{"type": "text", "text": "You are terse.",
                                                  "cache_control": {"type": "ephemeral"}}])
    blocks = [[{k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]]
              if isinstance(m["content"], list) else m["content"] for m in body["messages"]]
    assert blocks[1] == [{"type": "text", "text": "Let me check."},
                         {"type": "tool_use", "id": "call_1", "name": "get_weather",
                          "input": {"city": "Paris"}}]
    assert blocks[2][0]["type"] == "tool_result" and blocks[2][0]["tool_use_id"] == "call_1"
    assert body["tools"][0]["name"] == "get_weather"
    calls = [item for item in answer.output if item.type == "function_call"]
    assert [(c.call_id, json.loads(c.arguments)) for c in calls] == [("toolu_9", {"city": "Lyon"})]
    assert answer.output_text == "Cloudy."
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens == 32
    app.state.store.close()
    await pool.aclose()


class Forecast(BaseModel):
    city: str
    celsius: int


async def test_a_pydantic_text_format_parses(tmp_path: Path) -> None:
    """`responses.parse(text_format=Model)`: the upstream gets chat's json_schema
    response_format (the SDK's strict schema), and the SDK parses the answer's text."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant",
                                    "content": '{"city": "Oslo", "celsius": 4}'},
            "finish_reason": "stop"}], "usage": {"prompt_tokens": 9, "completion_tokens": 9}})

    pool = pool_over_handler(handler)
    app = gateway_app(tmp_path, pool)
    parsed = await sdk(app).responses.parse(model="m", input="Oslo?", text_format=Forecast)
    assert parsed.output_parsed == Forecast(city="Oslo", celsius=4)
    fmt = sent[0]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Forecast"
    assert fmt["json_schema"]["schema"]["required"] == ["city", "celsius"]
    app.state.store.close()
    await pool.aclose()


async def test_images_and_toolless_settings_reach_the_upstream_as_chat_takes_them(
        tmp_path: Path) -> None:
    """An `input_image` is chat's `image_url` part; an empty `tools`, `tool_choice` "auto" and
    `parallel_tool_calls` without tools (which the Responses API takes and chat completions
    refuses) are left out; a malformed image URL is a 400 naming the Responses field."""
    replicas = fake_replicas(1)
    pool = pool_over(replicas)
    app = gateway_app(tmp_path, pool)
    url = "https://example.com/cat.png"
    content = [{"type": "input_text", "text": "What is this?"},
               {"type": "input_image", "image_url": url, "detail": "low"}]
    client = sdk(app)
    await client.responses.create(model="fake", input=[{"role": "user", "content": content}],
                                  tools=[], tool_choice="auto", parallel_tool_calls=False)
    body = replicas[0].state.replica.config.bodies[0]
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        assert field not in body
    bad = [content[0], {"type": "input_image", "image_url": "ftp://x"}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="fake", input=[{"role": "user", "content": bad}])
    assert refused.value.param == "input[0].content[1].image_url"
    app.state.store.close()
    await pool.aclose()



async def test_an_anthropic_upstreams_refusal_names_the_responses_field(tmp_path: Path) -> None:
    """json_object cannot reach an Anthropic upstream (it takes a schema): the 400 names
    `text.format`, the field the Responses client sent, not chat's `response_format`."""
    pool = pool_over_handler(lambda request: httpx.Response(500), kind="anthropic",
                             url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk(app).responses.create(model="claude-test", input="Hi",
                                        text={"format": {"type": "json_object"}})
    assert refused.value.param == "text.format"
    assert "text.format" in refused.value.message
    app.state.store.close()
    await pool.aclose()


async def test_input_tokens_through_an_anthropic_upstream_is_estimated(tmp_path: Path) -> None:
    """An Anthropic upstream counts Messages bodies: a Responses body's count is prefixgate's
    estimate, never the chat body sent to Anthropic's count endpoint."""
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, json={"input_tokens": 1})

    pool = pool_over_handler(handler, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    counted = await sdk(app).responses.input_tokens.with_raw_response.count(
        model="claude-test", instructions="You are terse.", input=HISTORY, tools=TOOLS)
    assert counted.headers["x-prefixgate-usage"] == "estimated"
    assert counted.parse().input_tokens > 20
    assert paths == []
    app.state.store.close()
    await pool.aclose()


async def test_an_upstreams_refusal_of_a_message_names_its_input_item(tmp_path: Path) -> None:
    """The upstream saw chat messages (`instructions` became the first): its 400 naming
    `messages[3].content` reaches the Responses client as the item it came from, `input[2]`,
    whole and streamed (before, as `input` alone)."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {
            "message": "Invalid 'messages[3].content': string too long.",
            "type": "invalid_request_error", "param": "messages[3].content", "code": None}})

    pool = pool_over_handler(handler)
    app = gateway_app(tmp_path, pool)
    items = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk(app).responses.create(model="m", instructions="Be brief.", input=items,
                                            stream=stream)
        assert refused.value.param == "input[2].content"
        assert "Invalid 'input[2].content'" in refused.value.message
    app.state.store.close()
    await pool.aclose()


def test_messages_lint_rewrote_are_named_as_input() -> None:
    """When the messages sent are not the body's own translation (lint rewrote them), an
    index would name the wrong item: the error names `input`."""
    from gateway.errors import invalid
    from gateway.evolve import evolve
    from gateway.parse_responses import chat_body, client_error, parse_responses
    from gateway.validate import ParseContext

    body = {"model": "m", "input": [{"role": "user", "content": "a"},
                                    {"role": "user", "content": "b"}]}
    req = parse_responses(body, ParseContext("r1", "t", ("m",), grammar=False))
    assert req.body["messages"] == chat_body(body)[0]["messages"]
    own = client_error(invalid("bad 'messages[1].content'", "messages[1].content"), req)
    assert own.param == "input[1].content"
    rewritten = evolve(req, body={**req.body, "messages": req.body["messages"][::-1]})
    moved = client_error(invalid("bad 'messages[1].content'", "messages[1].content"), rewritten)
    assert moved.param == "input" and moved.message == "bad 'input'"
