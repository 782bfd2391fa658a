"""POST /v1/responses on the real embedded engine (SmolLM2-135M) through the openai SDK.

Independent references: `jsonschema` validates the forced call's arguments and the JSON
document against the schemas the client sent; the SDK's stream helper rebuilds the streamed
answer from its events, checked against the same request answered whole (greedy decoding).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather",
                     "description": "Current weather for a city.", "parameters": WEATHER,
                     "strict": True}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


def sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                             timeout=120)
    return openai.AsyncOpenAI(api_key="unused", base_url="http://gw/v1", http_client=http,
                              max_retries=0)


async def test_a_forced_function_call_parses_whole_and_streamed(make_real_app: Any) -> None:
    client = sdk(make_real_app())
    kwargs: dict[str, Any] = {
        "model": MODEL, "instructions": "Use the tools to answer.",
        "input": "What's the weather in Paris?", "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 48, "temperature": 0}
    whole = await client.responses.create(**kwargs)
    async with client.responses.stream(**kwargs) as events:
        streamed = await events.get_final_response()
    for answer in (whole, streamed):
        assert answer.status == "completed"
        calls = [item for item in answer.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        assert answer.usage is not None and answer.usage.output_tokens > 0
    assert [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in whole.output if c.type == "function_call"]


async def test_a_json_schema_text_format_validates(make_real_app: Any) -> None:
    client = sdk(make_real_app())
    answer = await client.responses.create(
        model=MODEL, input="Invent a person: a name and an age.", max_output_tokens=60,
        temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                        "schema": PERSON, "strict": True}})
    assert answer.status == "completed", answer.incomplete_details
    jsonschema.validate(json.loads(answer.output_text), PERSON)
    assert answer.text is not None and answer.text.format.type == "json_schema"


async def test_a_call_cut_by_max_output_tokens_is_finished_incomplete(make_real_app: Any
                                                                      ) -> None:
    """The forced call above cut by max_output_tokens after its head was streamed (20
    tokens, as the chat route's test of the same cut): the stream finishes that call's item
    `incomplete` and ends in `response.incomplete`; the whole answer leaves the call out."""
    client = sdk(make_real_app())
    kwargs: dict[str, Any] = {
        "model": MODEL, "instructions": "Use the tools to answer.",
        "input": "What's the weather in Paris?", "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 20, "temperature": 0}
    events = [e async for e in await client.responses.create(**kwargs, stream=True)]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in added] == ["function_call"]
    assert [(i.id, i.status) for i in done] == [(added[0].id, "incomplete")]
    assert events[-1].type == "response.incomplete"
    whole = await client.responses.create(**kwargs)
    assert whole.status == "incomplete"
    assert not [i for i in whole.output if i.type == "function_call"]


async def test_input_tokens_is_the_engines_prefill(make_real_app: Any) -> None:
    """The embedded engine's count is exact: the input tokens a generation of the same body
    reports."""
    client = sdk(make_real_app())
    kwargs: dict[str, Any] = {"model": MODEL, "instructions": "Use the tools to answer.",
                              "input": "What's the weather in Paris?", "tools": TOOLS}
    counted = await client.responses.input_tokens.count(**kwargs)
    answer = await client.responses.create(**kwargs, max_output_tokens=1)
    assert answer.usage is not None
    assert counted.input_tokens == answer.usage.input_tokens
