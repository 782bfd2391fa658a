"""An OpenAI-compatible upstream as agents see it through the official SDKs: finish reasons,
the provider's error codes, tool calls streamed as they come, model lookups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from pydantic import BaseModel

from gateway.backends.upstream_http import UpstreamOptions, client_timeout
from gateway.config import GatewayConfig

from .upstream_helpers import gateway_app, pool_over_handler, records

MESSAGES = [{"role": "user", "content": "hi"}]


def openai_sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://gw/v1", http_client=http,
                              max_retries=0)


def anthropic_sdk(app: Any) -> anthropic.AsyncAnthropic:
    # The anthropic SDK runs on httpx2, so its in-process transport comes from there.
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return anthropic.AsyncAnthropic(api_key="unused", base_url="http://gw", http_client=http,
                                    max_retries=0)


def sse(chunks: list[dict[str, Any]]) -> httpx.Response:
    """An OpenAI-style event stream of `chunks`, then `[DONE]`."""
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=text.encode())


def answer(text: str, finish: str) -> Any:
    """A handler answering every request with `text` and the finish reason `finish`, whole or
    streamed as the request asks."""
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}

    def handler(request: httpx.Request) -> httpx.Response:
        if not json.loads(request.content).get("stream"):
            return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish}], "usage": usage})
        return sse([{"choices": [{"index": 0, "delta": {"content": text},
                                  "finish_reason": None}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                    {"choices": [], "usage": usage}])
    return handler


@pytest.mark.parametrize("stream", [False, True])
async def test_a_content_filter_stop_reaches_the_client_as_one(tmp_path: Path,
                                                               stream: bool) -> None:
    """An upstream's `content_filter` finish is the OpenAI client's `content_filter` and the
    Anthropic client's `refusal`, whole and streamed: never a plain stop, which an agent would
    take for a finished answer."""
    pool = pool_over_handler(answer("I can", "content_filter"))
    app = gateway_app(tmp_path, pool)
    oai, anth = openai_sdk(app), anthropic_sdk(app)
    if stream:
        chunks = [c async for c in await oai.chat.completions.create(
            model="m", messages=MESSAGES, stream=True)]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        async with anth.messages.stream(model="m", max_tokens=9, messages=MESSAGES) as s:
            message = await s.get_final_message()
    else:
        finish = (await oai.chat.completions.create(
            model="m", messages=MESSAGES)).choices[0].finish_reason
        message = await anth.messages.create(model="m", max_tokens=9, messages=MESSAGES)
    assert finish == "content_filter"
    assert message.stop_reason == "refusal"
    app.state.store.close()
    await pool.aclose()


OPENAI_REFUSALS = [  # (status, the provider's error object) as api.openai.com answers them
    (400, {"message": "This model's maximum context length is 8192 tokens.",
           "type": "invalid_request_error", "param": "messages",
           "code": "context_length_exceeded"}),
    (429, {"message": "You exceeded your current quota.", "type": "insufficient_quota",
           "param": None, "code": "insufficient_quota"}),
    (400, {"message": "Invalid value for 'temperature'.", "type": "invalid_request_error",
           "param": "temperature", "code": "invalid_value"}),
]


@pytest.mark.parametrize(("status", "error"), OPENAI_REFUSALS)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_providers_error_code_and_param_reach_the_client(
        tmp_path: Path, status: int, error: dict[str, Any], stream: bool) -> None:
    """A refusal's `code` and `param` reach the OpenAI client as the provider sent them (an
    agent compacts its history on `context_length_exceeded` and stops retrying on
    `insufficient_quota`); the Anthropic client's message names the field."""
    pool = pool_over_handler(lambda request: httpx.Response(status, json={"error": error}))
    app = gateway_app(tmp_path, pool)
    with pytest.raises(openai.APIStatusError) as info:
        await openai_sdk(app).chat.completions.create(model="m", messages=MESSAGES,
                                                      stream=stream)
    assert info.value.status_code == status
    assert (info.value.code, info.value.param) == (error["code"], error["param"])
    assert error["message"] in info.value.message
    with pytest.raises(anthropic.APIStatusError) as anth:
        await anthropic_sdk(app).messages.create(model="m", max_tokens=9, messages=MESSAGES)
    assert anth.value.status_code == status
    message = anth.value.body["error"]["message"]  # type: ignore[index]
    assert error["message"] in message
    assert error["param"] is None or error["param"] in message
    app.state.store.close()
    await pool.aclose()


async def test_a_numeric_code_is_not_passed_on(tmp_path: Path) -> None:
    """vLLM's error `code` is the HTTP status, a number: the client's code stays the gateway's
    own (none for a plain 400), never a number where OpenAI's SDK expects text."""
    pool = pool_over_handler(lambda request: httpx.Response(400, json={"error": {
        "message": "bad", "type": "BadRequestError", "param": None, "code": 400}}))
    app = gateway_app(tmp_path, pool)
    with pytest.raises(openai.BadRequestError) as info:
        await openai_sdk(app).chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.code is None and info.value.param is None
    app.state.store.close()
    await pool.aclose()


CALLS = [("call_w1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
         ("call_t2", "get_time", '{"tz": "Europe/Paris"}')]


def fragments(arguments: str, size: int = 6) -> list[str]:
    """The arguments text in the pieces the upstream streams it in."""
    return [arguments[i:i + size] for i in range(0, len(arguments), size)]


def tool_stream(request: httpx.Request) -> httpx.Response:
    """Text, then two calls one after the other, each a head (id, name) and its arguments in
    fragments, as OpenAI and vLLM stream them."""
    def delta(**fields: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    chunks = [delta(role="assistant", content="Checking. ")]
    for i, (call_id, name, arguments) in enumerate(CALLS):
        chunks.append(delta(tool_calls=[{"index": i, "id": call_id, "type": "function",
                                         "function": {"name": name, "arguments": ""}}]))
        chunks += [delta(tool_calls=[{"index": i, "function": {"arguments": piece}}])
                   for piece in fragments(arguments)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 30}})
    return sse(chunks)


async def test_streamed_tool_calls_reach_an_openai_client_fragment_by_fragment(
        tmp_path: Path) -> None:
    """Each call's head and argument fragments reach the OpenAI client as the upstream sent
    them, before the finish (not held back and sent whole at the end: a long call's client
    saw nothing until it was done), and the SDK's stream helper rebuilds the calls."""
    pool = pool_over_handler(tool_stream)
    app = gateway_app(tmp_path, pool)
    client = openai_sdk(app)
    chunks = [c async for c in await client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True)]
    pieces: dict[int, list[str]] = {}
    heads = []
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            if call.id:
                heads.append((call.id, call.function.name if call.function else None))
            elif call.function and call.function.arguments:
                pieces.setdefault(call.index, []).append(call.function.arguments)
    assert heads == [(call_id, name) for call_id, name, _ in CALLS]
    assert pieces == {i: fragments(arguments) for i, (_, _, arguments) in enumerate(CALLS)}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    async with client.beta.chat.completions.stream(model="m", messages=MESSAGES) as s:
        final = await s.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == CALLS
    assert final.choices[0].message.content == "Checking. "
    app.state.store.close()
    await pool.aclose()


async def test_streamed_tool_calls_reach_an_anthropic_client_as_input_json_deltas(
        tmp_path: Path) -> None:
    """An Anthropic client gets a text block, then one tool_use block per call whose
    `input_json_delta`s are the upstream's fragments, in the order the SDK's stream helper
    accepts; its final message holds each call's input."""
    pool = pool_over_handler(tool_stream)
    app = gateway_app(tmp_path, pool)
    partials: list[str] = []
    async with anthropic_sdk(app).messages.stream(model="m", max_tokens=99,
                                                  messages=MESSAGES) as s:
        kinds = []
        async for event in s:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partials.append(event.delta.partial_json)
        message = await s.get_final_message()
    assert partials == [p for _, _, arguments in CALLS for p in fragments(arguments)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert message.stop_reason == "tool_use"
    assert message.content[0].type == "text" and message.content[0].text == "Checking. "
    uses = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert uses == [(call_id, name, json.loads(arguments)) for call_id, name, arguments in CALLS]
    app.state.store.close()
    await pool.aclose()


def interleaved_stream(request: httpx.Request) -> httpx.Response:
    """Both calls' heads, then their argument fragments taking turns (no known server
    streams so, but the protocol's `index` allows it)."""
    def delta(**fields: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    chunks = [delta(tool_calls=[{"index": i, "id": call_id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}])
              for i, (call_id, name, _) in enumerate(CALLS)]
    halves = [(i, arguments[:len(arguments) // 2], arguments[len(arguments) // 2:])
              for i, (_, _, arguments) in enumerate(CALLS)]
    chunks += [delta(tool_calls=[{"index": i, "function": {"arguments": first}}])
               for i, first, _ in halves]
    chunks += [delta(tool_calls=[{"index": i, "function": {"arguments": rest}}])
               for i, _, rest in halves]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return sse(chunks)


async def test_interleaved_call_fragments_never_land_in_another_call(tmp_path: Path) -> None:
    """Fragments taking turns between calls: the OpenAI client (fragments keyed by index)
    rebuilds every call; an Anthropic client's open tool_use block only ever gets its own
    call's fragments, so the last call's input is whole and none is another's JSON."""
    pool = pool_over_handler(interleaved_stream)
    app = gateway_app(tmp_path, pool)
    async with openai_sdk(app).beta.chat.completions.stream(model="m",
                                                            messages=MESSAGES) as s:
        final = await s.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == CALLS
    async with anthropic_sdk(app).messages.stream(model="m", max_tokens=99,
                                                  messages=MESSAGES) as stream:
        message = await stream.get_final_message()
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(b.id, b.name) for b in uses] == [(call_id, name) for call_id, name, _ in CALLS]
    assert uses[-1].input == json.loads(CALLS[-1][2])
    app.state.store.close()
    await pool.aclose()


REFUSAL = ["I'm sorry,", " I can't", " help with that."]


def refusing(request: httpx.Request) -> httpx.Response:
    """A structured-outputs refusal as OpenAI answers one: `message.refusal` (streamed:
    `delta.refusal` pieces), content null, finish reason stop."""
    if not json.loads(request.content).get("stream"):
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": None, "refusal": "".join(REFUSAL)}}]})
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None,
                                                  "refusal": ""}, "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"refusal": piece}, "finish_reason": None}]}
               for piece in REFUSAL]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return sse(chunks)


class City(BaseModel):
    city: str


@pytest.mark.parametrize("stream", [False, True])
async def test_a_structured_outputs_refusal_reaches_the_client(tmp_path: Path,
                                                               stream: bool) -> None:
    """The upstream's refusal is the OpenAI client's `message.refusal` (the SDK's parse
    helpers leave `parsed` None and say why; it had been lost, content an empty string), and
    an Anthropic client's text."""
    pool = pool_over_handler(refusing)
    app = gateway_app(tmp_path, pool)
    client, anth = openai_sdk(app), anthropic_sdk(app)
    if stream:
        async with client.beta.chat.completions.stream(
                model="m", messages=MESSAGES, response_format=City) as s:
            message = (await s.get_final_completion()).choices[0].message
        async with anth.messages.stream(model="m", max_tokens=9, messages=MESSAGES) as events:
            answer = await events.get_final_message()
    else:
        message = (await client.beta.chat.completions.parse(
            model="m", messages=MESSAGES, response_format=City)).choices[0].message
        answer = await anth.messages.create(model="m", max_tokens=9, messages=MESSAGES)
    assert (message.refusal, message.parsed) == ("".join(REFUSAL), None)
    assert not message.content  # null whole; a stream's head opened it as ""
    assert [(b.type, getattr(b, "text", None)) for b in answer.content] == [
        ("text", "".join(REFUSAL))]
    app.state.store.close()
    await pool.aclose()


ANTHROPIC_CALLS = [("toolu_1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
                   ("toolu_2", "list_files", "")]  # the second streams no input at all


def anthropic_tool_stream(request: httpx.Request) -> httpx.Response:
    """A Messages stream: a text block, then tool_use blocks whose input comes in
    `input_json_delta` fragments, as the Messages API streams them."""
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "msg_u", "type": "message",
                                              "role": "assistant", "content": [],
                                              "usage": {"input_tokens": 9, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text",
                                                                      "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                               "text": "Checking. "}},
        {"type": "content_block_stop", "index": 0}]
    for i, (call_id, name, arguments) in enumerate(ANTHROPIC_CALLS, start=1):
        events.append({"type": "content_block_start", "index": i, "content_block": {
            "type": "tool_use", "id": call_id, "name": name, "input": {}}})
        events += [{"type": "content_block_delta", "index": i, "delta": {
            "type": "input_json_delta", "partial_json": piece}} for piece in fragments(arguments)]
        events.append({"type": "content_block_stop", "index": i})
    events += [{"type": "message_delta", "delta": {"stop_reason": "tool_use",
                                                   "stop_sequence": None},
                "usage": {"output_tokens": 30}}, {"type": "message_stop"}]
    text = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=text.encode())


async def test_an_anthropic_upstreams_tool_calls_reach_an_openai_client_as_they_come(
        tmp_path: Path) -> None:
    """An OpenAI client of an Anthropic upstream gets each tool_use block as a call's head and
    its input's fragments as argument fragments, as they come (they were held to the end);
    a call that streamed no input has arguments `{}`, as the whole answer says."""
    pool = pool_over_handler(anthropic_tool_stream, kind="anthropic",
                             url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    client = openai_sdk(app)
    chunks = [c async for c in await client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True)]
    pieces: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            if call.id is None and call.function and call.function.arguments:
                pieces.setdefault(call.index, []).append(call.function.arguments)
    assert pieces == {0: fragments(ANTHROPIC_CALLS[0][2]), 1: ["{}"]}
    async with client.beta.chat.completions.stream(model="m", messages=MESSAGES) as s:
        final = await s.get_final_completion()
    calls = [(c.id, c.function.name, c.function.arguments)
             for c in final.choices[0].message.tool_calls or []]
    assert calls == [(i, n, a or "{}") for i, n, a in ANTHROPIC_CALLS]
    assert final.choices[0].finish_reason == "tool_calls"
    app.state.store.close()
    await pool.aclose()


def test_a_whole_answer_may_take_as_long_as_the_sdks_wait() -> None:
    """An upstream's answer may stay silent as long as the SDKs themselves wait for it (600 s
    read): a whole answer sends nothing until its last token, so a 2-minute generation was a
    504 at the gateway's 60 s, run again on every replica and each marked failed."""
    sdk_read = min(openai.DEFAULT_TIMEOUT.read or 0, anthropic.DEFAULT_TIMEOUT.read or 0)
    assert GatewayConfig().upstream_timeout_s >= sdk_read
    assert client_timeout(UpstreamOptions(url="http://up.test/v1")).read >= sdk_read


def idless_calls(request: httpx.Request) -> httpx.Response:
    """A server that sends its tool calls without ids (whole and streamed); any request that
    carries a tool result is answered with text."""
    body = json.loads(request.content)
    if any(m.get("role") == "tool" for m in body["messages"]):
        return answer("Sunny.", "stop")(request)
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": '{"city": "Paris"}'}}
    if not body.get("stream"):
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [call]}}]})
    return sse([{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **call}]},
                              "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_the_upstream_sent_without_an_id_can_be_answered(tmp_path: Path,
                                                                      stream: bool) -> None:
    """A tool call without an id gets one, the same in a stream's head and its end, so the
    agent's next turn (the call and its result, by that id) is served: with the empty id the
    gateway handed out, that turn was the gateway's own 400 ('must be a non-empty string')."""
    pool = pool_over_handler(idless_calls)
    app = gateway_app(tmp_path, pool)
    client, anth = openai_sdk(app), anthropic_sdk(app)
    if stream:
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True)]
        ids = {t.id for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()
               if t.id is not None}
        async with client.beta.chat.completions.stream(model="m", messages=MESSAGES) as s:
            [call] = (await s.get_final_completion()).choices[0].message.tool_calls or []
        async with anth.messages.stream(model="m", max_tokens=9, messages=MESSAGES) as events:
            [use] = [b for b in (await events.get_final_message()).content
                     if b.type == "tool_use"]
        assert len(ids) == 1 and "" not in ids
    else:
        [call] = (await client.chat.completions.create(
            model="m", messages=MESSAGES)).choices[0].message.tool_calls or []
        [use] = [b for b in (await anth.messages.create(
            model="m", max_tokens=9, messages=MESSAGES)).content if b.type == "tool_use"]
    assert call.id and use.id
    turn = await client.chat.completions.create(model="m", messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21C"}])
    assert turn.choices[0].message.content == "Sunny."
    answered = await anth.messages.create(model="m", max_tokens=9, messages=[
        *MESSAGES, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "21C"}]}])
    assert [b.text for b in answered.content if b.type == "text"] == ["Sunny."]
    app.state.store.close()
    await pool.aclose()


def indexless_stream(request: httpx.Request) -> httpx.Response:
    """Parallel calls streamed without `index` (each call's id, name and arguments in one
    delta, then a fragment more of the second without an id), as some OpenAI-compatible APIs
    stream them."""
    def delta(call: dict[str, Any]) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"tool_calls": [call]},
                             "finish_reason": None}]}

    (id_a, name_a, args_a), (id_b, name_b, args_b) = CALLS
    return sse([
        delta({"id": id_a, "type": "function",
               "function": {"name": name_a, "arguments": args_a}}),
        delta({"id": id_b, "type": "function",
               "function": {"name": name_b, "arguments": args_b[:5]}}),
        delta({"function": {"arguments": args_b[5:]}}),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}])


async def test_parallel_calls_streamed_without_an_index_stay_apart(tmp_path: Path) -> None:
    """Calls streamed without `index` are told apart by their ids (a fragment without one
    continues the last call): they had all been folded into call 0, one call whose arguments
    were two JSON objects run together."""
    pool = pool_over_handler(indexless_stream)
    app = gateway_app(tmp_path, pool)
    async with openai_sdk(app).beta.chat.completions.stream(model="m",
                                                            messages=MESSAGES) as s:
        final = await s.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == CALLS
    async with anthropic_sdk(app).messages.stream(model="m", max_tokens=9,
                                                  messages=MESSAGES) as events:
        message = await events.get_final_message()
    assert [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        (call_id, name, json.loads(arguments)) for call_id, name, arguments in CALLS]
    app.state.store.close()
    await pool.aclose()


def forced_call(request: httpx.Request) -> httpx.Response:
    """A forced tool call answered as OpenAI and vLLM answer one: the call, finish "stop"."""
    call = {"id": "call_f1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    if not json.loads(request.content).get("stream"):
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": None, "tool_calls": [call]}}]})
    return sse([{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **call}]},
                              "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_is_tool_use_to_an_anthropic_client(tmp_path: Path,
                                                                stream: bool) -> None:
    """A tool call the upstream ended with "stop" (a forced tool_choice) is stop_reason
    "tool_use" to an Anthropic client, as Anthropic's API says for any answer that calls a
    tool (it was "end_turn": an agent loop ended without running the tool); the OpenAI
    client keeps the upstream's own "stop"."""
    pool = pool_over_handler(forced_call)
    app = gateway_app(tmp_path, pool)
    anth = anthropic_sdk(app)
    choice = {"type": "tool", "name": "get_weather"}
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    if stream:
        async with anth.messages.stream(model="m", max_tokens=9, messages=MESSAGES,
                                        tools=tools, tool_choice=choice) as events:
            message = await events.get_final_message()
    else:
        message = await anth.messages.create(model="m", max_tokens=9, messages=MESSAGES,
                                             tools=tools, tool_choice=choice)
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"]
    chat = await openai_sdk(app).chat.completions.create(model="m", messages=MESSAGES)
    assert chat.choices[0].finish_reason == "stop"
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize("finish", ["abort", "error"])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_the_server_aborted_is_an_error(tmp_path: Path, finish: str,
                                                        stream: bool) -> None:
    """An answer the server ended with finish_reason "abort" (vLLM, SGLang) or "error" is not
    the whole answer: a 502 (streamed: the error event, which the SDKs raise), never the
    "stop" / "end_turn" an agent took for a finished answer."""
    pool = pool_over_handler(answer("Partial", finish))
    app = gateway_app(tmp_path, pool)
    with pytest.raises(openai.APIError) as info:
        if stream:
            async for _ in await openai_sdk(app).chat.completions.create(
                    model="m", messages=MESSAGES, stream=True):
                pass
        else:
            await openai_sdk(app).chat.completions.create(model="m", messages=MESSAGES)
    assert finish in info.value.message
    with pytest.raises(anthropic.APIError):
        if stream:
            async with anthropic_sdk(app).messages.stream(model="m", max_tokens=9,
                                                          messages=MESSAGES) as events:
                await events.get_final_message()
        else:
            await anthropic_sdk(app).messages.create(model="m", max_tokens=9,
                                                     messages=MESSAGES)
    assert [r.status for r in records(app)] == [502, 502]
    app.state.store.close()
    await pool.aclose()


def invalid_arguments(request: httpx.Request) -> httpx.Response:
    """A call whose arguments a model wrote as no JSON (Python's quotes), in fragments."""
    arguments = "{'city': 'Paris'}"
    call = {"id": "call_q", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    if not json.loads(request.content).get("stream"):
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [call]}}]})
    head = {**call, "function": {"name": "get_weather", "arguments": ""}}
    chunks = [{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **head}]},
                            "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": piece}}]}, "finish_reason": None}]}
        for piece in fragments(arguments, 4)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return sse(chunks)


async def test_invalid_streamed_arguments_do_not_end_an_anthropic_clients_stream(
        tmp_path: Path) -> None:
    """Arguments that are no JSON reach an Anthropic client's stream only while they are a
    JSON prefix: its SDK (which parses the input after every fragment) ends with the same
    message as the whole answer's (the call, input {}), where it had raised mid-stream."""
    pool = pool_over_handler(invalid_arguments)
    app = gateway_app(tmp_path, pool)
    anth = anthropic_sdk(app)
    whole = await anth.messages.create(model="m", max_tokens=9, messages=MESSAGES)
    async with anth.messages.stream(model="m", max_tokens=9, messages=MESSAGES) as events:
        streamed = await events.get_final_message()
    assert [(b.type, b.id, b.input) for b in streamed.content] == [
        (b.type, b.id, b.input) for b in whole.content] == [("tool_use", "call_q", {})]
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    app.state.store.close()
    await pool.aclose()


THOUGHTS = ["The user says hi. ", "A greeting back ", "will do."]


def reasoning_model(request: httpx.Request) -> httpx.Response:
    """A reasoning model behind vLLM's reasoning parser: `reasoning_content` (streamed: its
    pieces) before the answer's content."""
    if not json.loads(request.content).get("stream"):
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", "content": "Hello!",
                "reasoning_content": "".join(THOUGHTS)}}]})
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                            "finish_reason": None}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"reasoning_content": piece},
                             "finish_reason": None}]} for piece in THOUGHTS]
    chunks += [{"choices": [{"index": 0, "delta": {"content": "Hello!"}, "finish_reason": None}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    return sse(chunks)


async def test_a_reasoning_models_reasoning_reaches_an_openai_client(tmp_path: Path) -> None:
    """The upstream's `reasoning_content` reaches an OpenAI client as it came: each piece a
    chunk's `delta.reasoning_content`, before the answer (it was dropped, so a client got
    nothing, not even the response's head, while the model thought), and the whole answer's
    `message.reasoning_content`. An Anthropic client gets the answer's text."""
    pool = pool_over_handler(reasoning_model)
    app = gateway_app(tmp_path, pool)
    client = openai_sdk(app)
    chunks = [c async for c in await client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True)]
    said = [(d.model_extra or {}).get("reasoning_content") or d.content
            for d in (c.choices[0].delta for c in chunks if c.choices)]
    assert [s for s in said if s] == [*THOUGHTS, "Hello!"]
    whole = (await client.chat.completions.create(model="m", messages=MESSAGES))
    message = whole.choices[0].message
    assert (message.content, (message.model_extra or {}).get("reasoning_content")) == (
        "Hello!", "".join(THOUGHTS))
    async with anthropic_sdk(app).messages.stream(model="m", max_tokens=9,
                                                  messages=MESSAGES) as events:
        answer = await events.get_final_message()
    assert [(b.type, getattr(b, "text", None)) for b in answer.content] == [("text", "Hello!")]
    app.state.store.close()
    await pool.aclose()


def ignores_stream(request: httpx.Request) -> httpx.Response:
    """A server that ignores `"stream": true`: every answer is one whole JSON body, text and
    a tool call."""
    return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
        "index": 0, "message": {
            "role": "assistant", "content": "Reading it now.",
            "tool_calls": [{"id": "call_7", "type": "function", "function": {
                "name": "read_file", "arguments": '{"path": "src/app.py"}'}}]},
        "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17}})


async def test_a_whole_answer_to_a_streamed_request_is_streamed(tmp_path: Path) -> None:
    """A server that answers a streamed request with a whole JSON body still gives the client
    a proper stream: its text, tool calls and finish are those of the same request asked
    whole (the reference), for an OpenAI client and an Anthropic one; never a stream cut."""
    pool = pool_over_handler(ignores_stream)
    app = gateway_app(tmp_path, pool)
    client = openai_sdk(app)
    whole = (await client.chat.completions.create(model="m", messages=MESSAGES)).choices[0]
    text, calls, finish = "", dict[int, dict[str, str]](), None
    async for chunk in await client.chat.completions.create(model="m", messages=MESSAGES,
                                                            stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            fn = piece.function
            call["name"] += (fn.name or "") if fn else ""
            call["arguments"] += (fn.arguments or "") if fn else ""
        finish = chunk.choices[0].finish_reason or finish
    assert whole.message.tool_calls is not None
    assert (text, finish) == (whole.message.content, whole.finish_reason) != ("", None)
    assert list(calls.values()) == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls]
    anth = anthropic_sdk(app)
    reference = await anth.messages.create(model="m", max_tokens=50, messages=MESSAGES)
    async with anth.messages.stream(model="m", max_tokens=50, messages=MESSAGES) as stream:
        streamed = await stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [
        b.model_dump() for b in reference.content]
    assert streamed.stop_reason == reference.stop_reason == "tool_use"
    assert [r.status for r in records(app)] == [200] * 4
    app.state.store.close()
    await pool.aclose()
