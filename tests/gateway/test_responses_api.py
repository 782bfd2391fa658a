"""POST /v1/responses over the fake backend: refusals in OpenAI's error format naming the
Responses field, the route's records and metrics, lint, the max_tokens cap.

References: OpenAI's error body shape (`{"error": {message, type, param, code}}`, what the SDK
reads into `BadRequestError.param`), the field names of the Responses API written out by hand.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from sqlalchemy import select

from gateway.stats import RequestRecord

from .gateway_fakes import FAKE_MODEL, FakeBackend, asgi_client

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


def records(app: Any) -> list[RequestRecord]:
    store = app.state.store
    store.flush()
    with store.session() as session:
        return list(session.scalars(select(RequestRecord).order_by(RequestRecord.id)))


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"conversation": "conv_1"}, "conversation", "stateless"),
    ({"background": True}, "background", "stateless"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type",
     "file_search"),
    ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    ({"input": 5}, "input", "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "'input'"),
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0].type", "computer_call"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stateless"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "input[0].content[0].type", "input_text"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "see"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[1]", "text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "call_id"),
    ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name",
     "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name",
     "g"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters",
     "tools[0].parameters"),
    ({"metadata": {"a": 1}}, "metadata.a", "metadata.a"),
    ({"top_logprobs": 3}, "top_logprobs", "log-probabilities"),
    # the embedded engine: a call left unanswered, an output answering no call
    ({"input": [{"role": "user", "content": "hi"}, CALL, {"role": "user", "content": "and"}],
      "tools": [TOOL]}, "input[1]", "call_1"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output",
                                                     "call_id": "call_9", "output": "x"}]},
     "input[1].call_id", "call_9"),
]


@pytest.mark.parametrize(("change", "param", "says"), REFUSED,
                         ids=[p for _, p, _ in REFUSED])
async def test_a_bad_request_is_a_400_naming_the_responses_field(
        make_fake_app: Any, change: dict[str, Any], param: str, says: str) -> None:
    app = make_fake_app()
    body = {"model": FAKE_MODEL, "input": "hello", **change}
    async with asgi_client(app) as http:
        answer = await http.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"]
    assert [r.route for r in records(app)] == ["responses"]


async def test_the_sdk_reads_the_refusal(make_fake_app: Any) -> None:
    """The official client raises BadRequestError with the field; an unknown model is its
    NotFoundError."""
    app = make_fake_app()
    client = openai.AsyncOpenAI(api_key="k", base_url="http://gateway/v1", max_retries=0,
                                http_client=asgi_client(app))
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=FAKE_MODEL, input="hi",
                                      previous_response_id="resp_123")
    assert refused.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="nope", input="hi")
    assert missing.value.code == "model_not_found"


async def test_records_and_metrics_name_the_route(make_fake_app: Any,
                                                  fake_backend: FakeBackend) -> None:
    """One record per request, route `responses`, with its usage; /metrics labels the route."""
    app = make_fake_app()
    async with asgi_client(app) as http:
        whole = await http.post("/v1/responses", json={"model": FAKE_MODEL, "input": "a b c"})
        streamed = await http.post("/v1/responses", json={"model": FAKE_MODEL, "input": "a b",
                                                          "stream": True})
        metrics = (await http.get("/metrics")).text
    assert whole.status_code == streamed.status_code == 200
    assert whole.json()["usage"]["input_tokens"] == int(whole.headers["x-prefixgate-prompt-tokens"])
    rows = records(app)
    assert [(r.route, r.provider, r.status, r.stream) for r in rows] == [
        ("responses", "openai", 200, False), ("responses", "openai", 200, True)]
    assert rows[0].prompt_tokens == whole.json()["usage"]["input_tokens"]
    assert rows[0].completion_tokens == whole.json()["usage"]["output_tokens"]
    assert 'prefixgate_requests_total{backend="embedded",route="responses",status="200"} 2.0' \
        in metrics.splitlines()


async def test_lint_rewrites_the_chat_body_and_the_answer_echoes_the_clients(
        make_fake_app: Any, fake_backend: FakeBackend) -> None:
    """Rewrite mode moves a timestamp out of the instructions (the request served is the
    rewritten chat one); the Response still echoes the instructions the client sent."""
    pytest.importorskip("prompt_lint")
    app = make_fake_app(lint_mode="rewrite")
    stamped = "Current time: 2026-11-29T14:03:07Z. You are a shop assistant."
    async with asgi_client(app) as http:
        answer = await http.post("/v1/responses", json={
            "model": FAKE_MODEL, "instructions": stamped, "input": "hello"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-prefixgate-lint"]
    served = fake_backend.seen[-1].messages
    assert "2026-11-29T14:03:07" not in served[0]["content"]
    assert "2026-11-29T14:03:07Z" in served[-1]["content"]
    assert answer.json()["instructions"] == stamped


async def test_max_output_tokens_is_capped(make_fake_app: Any, fake_backend: FakeBackend) -> None:
    """`max_output_tokens` past the gateway's cap is served (and echoed) at the cap, as
    chat's max_tokens is."""
    app = make_fake_app(max_tokens_cap=5)
    async with asgi_client(app) as http:
        answer = await http.post("/v1/responses", json={
            "model": FAKE_MODEL, "input": "hello", "max_output_tokens": 100})
    assert answer.status_code == 200
    assert fake_backend.seen[-1].options.max_tokens == 5
    assert answer.json()["max_output_tokens"] == 5


async def test_a_get_is_a_405_in_openais_format(make_fake_app: Any) -> None:
    app = make_fake_app()
    async with asgi_client(app) as http:
        answer = await http.get("/v1/responses")
    assert answer.status_code == 405
    assert "error" in answer.json()


async def test_an_error_mid_stream_is_response_failed(make_fake_app: Any) -> None:
    """The fake backend's BREAK fails after two words: the events so far, then
    `response.failed` carrying the error; the record says 502."""
    app = make_fake_app()
    client = openai.AsyncOpenAI(api_key="k", base_url="http://gateway/v1", max_retries=0,
                                http_client=asgi_client(app))
    events = [e async for e in await client.responses.create(
        model=FAKE_MODEL, input="BREAK one two three", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    assert kinds[-1] == "response.failed"
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "server_error"
    assert [r.status for r in records(app)] == [502]



STREAM_EVENT: Any = TypeAdapter(ResponseStreamEvent)


def sse_events(text: str) -> list[dict[str, Any]]:
    """The `data:` payloads of an event stream, each checked against its `event:` name."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append(data)
    return out


@pytest.mark.parametrize("prompt", ["a b c", 'CALL f {"x": 1}', "BREAK a b c"])
async def test_every_event_and_response_validates_against_the_sdk_types(
        make_fake_app: Any, prompt: str) -> None:
    """Strict validation (the SDK itself only constructs its models, leniently): each event
    is one of the SDK's `ResponseStreamEvent` types with every required field, and each
    whole answer an SDK `Response`: a text answer, a tool call (each capped to 3 output
    tokens, so incomplete, as well), a failure mid-stream."""
    app = make_fake_app()
    async with asgi_client(app) as http:
        for cap in (None, 3):
            body = {"model": FAKE_MODEL, "input": prompt, "tools": [TOOL],
                    "max_output_tokens": cap}
            streamed = await http.post("/v1/responses", json={**body, "stream": True})
            events = sse_events(streamed.text)
            for event in events:
                STREAM_EVENT.validate_python(event, strict=False)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            last = events[-1]
            if prompt.startswith("BREAK") and cap is None:  # (capped: done before the break)
                assert last["type"] == "response.failed"
                continue
            whole = await http.post("/v1/responses", json=body)
            answer = Response.model_validate(whole.json())
            assert answer.status == last["response"]["status"]
            assert [i.type for i in answer.output] == \
                [i["type"] for i in last["response"]["output"]]
            assert (answer.status == "incomplete") == (cap is not None)


async def test_a_backend_error_names_the_responses_field(make_fake_app: Any) -> None:
    """A backend saw the chat request: its error naming `messages` reaches the Responses
    client as `input`."""
    app = make_fake_app()
    async with asgi_client(app) as http:
        for stream in (False, True):
            answer = await http.post("/v1/responses", json={
                "model": FAKE_MODEL, "input": "FAIL 400", "stream": stream})
            assert answer.status_code == 400
            assert answer.json()["error"]["param"] == "input"


async def test_input_tokens_counts_a_responses_body(make_fake_app: Any) -> None:
    """`responses.input_tokens.count` (POST /v1/responses/input_tokens): validated as
    /v1/responses validates, answered in the SDK's shape; the fake backend counts nothing
    itself, so the count is prefixgate's estimate, and says so."""
    app = make_fake_app()
    client = openai.AsyncOpenAI(api_key="k", base_url="http://gateway/v1", max_retries=0,
                                http_client=asgi_client(app))
    short = await client.responses.input_tokens.with_raw_response.count(
        model=FAKE_MODEL, input="hello")
    longer = await client.responses.input_tokens.count(
        model=FAKE_MODEL, instructions="Answer in French.", input="hello there", tools=[TOOL])
    assert short.headers["x-prefixgate-usage"] == "estimated"
    counted = short.parse()
    assert counted.object == "response.input_tokens"
    assert 0 < counted.input_tokens < longer.input_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.input_tokens.count(model=FAKE_MODEL, input="hi",
                                                  previous_response_id="resp_1")
    assert refused.value.param == "previous_response_id"
    assert records(app) == []  # a count generates nothing: no record


async def test_a_stored_response_is_not_found_and_says_why(make_fake_app: Any) -> None:
    """`responses.retrieve` / `delete`: a 404 in OpenAI's format saying nothing is kept."""
    app = make_fake_app()
    client = openai.AsyncOpenAI(api_key="k", base_url="http://gateway/v1", max_retries=0,
                                http_client=asgi_client(app))
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as missing:
            await call("resp_123")
        assert "stateless" in missing.value.message
