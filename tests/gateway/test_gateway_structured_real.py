"""Structured outputs from the real model (SmolLM2-135M) through the official SDKs.

Independent reference: `jsonschema` validates every tool call's arguments and every JSON
document against the schema the client sent; streaming is checked against the same request
answered without streaming (greedy decoding, one request at a time, so the same tokens).
The 20 requests of a test run concurrently (one batch in the engine) with small max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.support import serve

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant. Use the tools to answer."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000,
                                               "maximum": 1000},
                                        "b": {"type": "integer", "minimum": -1000,
                                              "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {
    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
    "label": {"type": "string", "enum": ["work", "gym", "school", "other"]}},
    "required": ["hour", "label"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "set_alarm": ALARM}
DESCRIPTIONS = {"get_weather": "Current weather for a city.", "add": "Add two integers.",
                "set_alarm": "Set an alarm at an hour of the day."}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n],
                                                  "parameters": s}} for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": DESCRIPTIONS[n], "input_schema": s}
                   for n, s in SCHEMAS.items()]
PROMPTS = [
    "What's the weather in Paris?", "Is it raining in Tokyo right now?", "Add 2 and 40.",
    "What is 17 plus 25?", "Wake me up at 7 for work.", "Set an alarm for 18 o'clock, gym.",
    "How hot is it in Cairo?", "Sum of 100 and -3?", "Weather in New York please.",
    "I need an alarm at 6 for school.", "Compute 5 + 9.", "Should I take a coat in Oslo?",
    "What is 12 plus 30?", "Alarm at 22, label other.", "Temperature in Lima?",
    "Please add 7 and 8.", "Is it sunny in Madrid?", "Remind me at 9 for work.",
    "What's 300 plus 45?", "Weather report for Berlin.",
]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"], "additionalProperties": False}


def salt() -> str:
    return uuid.uuid4().hex[:12]


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def check_openai_calls(message: Any) -> list[tuple[str, Any]]:
    """Each call parses and validates against its tool's schema; returns (name, args)."""
    assert message.tool_calls, f"no tool call in {message!r}"
    out = []
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


async def test_openai_required_tool_calls_always_validate(make_real_app):
    app = make_real_app()
    with serve(app) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        extra = {"cache_salt": salt()}

        async def ask(i: int, prompt: str) -> Any:
            choice: Any = "required"
            if i % 5 == 4:  # a named choice forces that tool
                choice = {"type": "function", "function": {"name": "add"}}
            return await client.chat.completions.create(
                model=MODEL, messages=messages(prompt), tools=OPENAI_TOOLS, tool_choice=choice,
                max_tokens=48, temperature=0.7 if i % 2 else 0, seed=i, extra_body=extra)

        replies = await asyncio.gather(*(ask(i, p) for i, p in enumerate(PROMPTS)))
        await client.close()
    valid = 0
    for i, reply in enumerate(replies):
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = check_openai_calls(reply.choices[0].message)
        if i % 5 == 4:
            assert {name for name, _ in calls} == {"add"}
        valid += 1
    assert valid == len(PROMPTS) == 20


async def test_openai_json_schema_documents_always_validate(make_real_app):
    app = make_real_app()
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with serve(app) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        replies = await asyncio.gather(*(
            client.chat.completions.create(
                model=MODEL, messages=messages(f"Describe a person related to: {p}"),
                response_format=fmt, max_tokens=40, temperature=0.7 if i % 2 else 0, seed=i,
                extra_body={"cache_salt": salt()})
            for i, p in enumerate(PROMPTS)))
        await client.close()
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert len(replies) == 20


async def test_anthropic_output_format_documents_always_validate(make_real_app):
    """Anthropic's output_config.format json_schema: the answer's text is a JSON document that
    validates (it was ignored and free text came back). Anthropic has no seed, so the sampled
    half differs run to run: max_tokens bounds the longest document the schema allows (two
    strings of at most 20 ASCII letters, at most a token each, an age, keys and punctuation)."""
    app = make_real_app()
    words = {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}
    schema = {**PERSON, "properties": {**PERSON["properties"], "name": words, "city": words}}
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    with serve(app) as server:
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key="none", max_retries=0)
        replies = await asyncio.gather(*(
            client.messages.create(
                model=MODEL, system=SYSTEM, max_tokens=80, output_config=fmt,
                messages=[{"role": "user", "content": f"Describe a person related to: {p}"}],
                extra_body={"cache_salt": salt(), "temperature": 0.7 if i % 2 else 0})
            for i, p in enumerate(PROMPTS[:6])))
        await client.close()
    for reply in replies:
        assert reply.stop_reason == "end_turn"
        jsonschema.validate(json.loads(reply.content[0].text), schema)


async def test_anthropic_any_tool_use_always_validates(make_real_app):
    app = make_real_app()
    with serve(app) as server:
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key="none", max_retries=0)
        extra = {"cache_salt": salt()}
        async with client:
            replies = await asyncio.gather(*(
            client.messages.create(
                model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": p}],
                tools=ANTHROPIC_TOOLS, max_tokens=48,
                tool_choice={"type": "tool", "name": "get_weather"} if i % 5 == 4
                else {"type": "any"}, extra_body={**extra, "temperature": 0.7 if i % 2 else 0})
                for i, p in enumerate(PROMPTS)))
    for i, reply in enumerate(replies):
        assert reply.stop_reason == "tool_use"
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses
        for use in uses:
            jsonschema.validate(use.input, SCHEMAS[use.name])
            assert i % 5 != 4 or use.name == "get_weather"
    assert len(replies) == 20


async def test_stop_strings_never_cut_a_forced_call_or_a_document(make_real_app):
    """Stop strings that every call's and document's JSON contains ('"', "}") ended the answer
    inside it: the forced call came back as no call at all, the document as broken JSON. They
    end free text only; a grammar-shaped output always comes back whole."""
    app = make_real_app()
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with serve(app) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="none", max_retries=0)
        extra = {"cache_salt": salt()}
        calls = [client.chat.completions.create(
            model=MODEL, messages=messages(p), tools=OPENAI_TOOLS, tool_choice="required",
            stop=['"', "}"], max_tokens=48, temperature=0, extra_body=extra)
            for p in PROMPTS[:3]]
        docs = [client.chat.completions.create(
            model=MODEL, messages=messages(f"Describe a person related to: {p}"),
            response_format=fmt, stop=['"'], max_tokens=40, temperature=0, extra_body=extra)
            for p in PROMPTS[:3]]
        uses = [claude.messages.create(
            model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": p}],
            tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, stop_sequences=['"'],
            max_tokens=48, extra_body={**extra, "temperature": 0})
            for p in PROMPTS[:3]]
        replies = await asyncio.gather(*calls, *docs, *uses)
        await client.close()
        await claude.close()
    for reply in replies[:3]:
        assert reply.choices[0].finish_reason == "tool_calls"
        check_openai_calls(reply.choices[0].message)
    for reply in replies[3:6]:
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    for reply in replies[6:]:
        assert reply.stop_reason == "tool_use" and reply.stop_sequence is None
        for use in (b for b in reply.content if b.type == "tool_use"):
            jsonschema.validate(use.input, SCHEMAS[use.name])


def test_streamed_tool_calls_reassemble_to_the_same_calls(make_real_app):
    app = make_real_app()
    prompt, extra = "What's the weather in Paris?", {"cache_salt": salt()}
    with serve(app) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        body = dict(model=MODEL, messages=messages(prompt), tools=OPENAI_TOOLS,
                    tool_choice="required", max_tokens=40, temperature=0, extra_body=extra)
        whole = oai.chat.completions.create(**body)
        chunks = list(oai.chat.completions.create(**body, stream=True))
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        with claude.messages.stream(
            model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": prompt}],
            tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, max_tokens=40,
            extra_body={**extra, "temperature": 0},
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        oai.close()
        claude.close()
    expected = check_openai_calls(whole.choices[0].message)
    # OpenAI: several argument fragments per call, joined in index order
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for piece in pieces:
        args[piece.index] = args.get(piece.index, "") + (piece.function.arguments or "")
        if piece.function.name:
            names[piece.index] = piece.function.name
    assert len(pieces) > len(args) + 1, "arguments did not stream in fragments"
    assert [(names[i], json.loads(args[i])) for i in sorted(args)] == expected
    whole_args = [c.function.arguments for c in whole.choices[0].message.tool_calls or ()]
    assert [args[i] for i in sorted(args)] == whole_args  # the same strings, byte for byte
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Anthropic: input_json_delta fragments that the SDK accumulates into the same input
    deltas = [e for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert len(deltas) > 1
    uses = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert uses == expected


@pytest.mark.parametrize(("max_tokens", "head_sent"), [(3, False), (14, False), (20, True)])
def test_a_call_cut_by_max_tokens_never_becomes_text(make_real_app, max_tokens, head_sent):
    """The forced call of the test above cut by max_tokens inside its opening tag (3: the
    output is `<tool_`, which came back as content, whole and streamed, before the fix), its
    name (14) or its arguments (20): the stream sends the call's head and argument fragments
    once the name is complete, then finish_reason "length", and no content (before, the raw
    `<tool_call>` block followed as content); the whole answer says the same: no content, no
    call that cannot parse. Anthropic: no text."""
    app = make_real_app()
    prompt, extra = "What's the weather in Paris?", {"cache_salt": salt()}
    with serve(app) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        body = dict(model=MODEL, messages=messages(prompt), tools=OPENAI_TOOLS,
                    tool_choice="required", max_tokens=max_tokens, temperature=0,
                    extra_body=extra)
        whole = oai.chat.completions.create(**body)
        chunks = list(oai.chat.completions.create(**body, stream=True))
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        final = claude.messages.create(
            model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": prompt}],
            tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, max_tokens=max_tokens,
            extra_body={**extra, "temperature": 0}, stream=True)
        events = list(final)
        whole_claude = claude.messages.create(
            model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": prompt}],
            tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, max_tokens=max_tokens,
            extra_body={**extra, "temperature": 0})
        oai.close()
        claude.close()
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert any(d.tool_calls for d in deltas) == head_sent
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].choices[0].finish_reason == "length"
    message = whole.choices[0]
    assert message.finish_reason == "length" and not message.message.content
    assert not message.message.tool_calls
    kinds = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert kinds == ["tool_use"] * int(head_sent)  # no empty text block, which the API never
    assert whole_claude.content == []  # sends and refuses when a client sends the turn back
    assert whole_claude.stop_reason == "max_tokens"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta"
                   and e.delta.type == "text_delta") == ""
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["max_tokens"]


def test_two_step_tool_example_completes(make_real_app):
    """examples/openai_tool_task.py: a validated call, the local result fed back, an answer."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "openai_tool_task.py"
    spec = importlib.util.spec_from_file_location("prefixgate_example_tool_task", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    with serve(make_real_app()) as server, openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0
    ) as client:
        result = module.run_task(client)
    assert result.call_name == "stock_level"
    jsonschema.validate(result.call_arguments, module.TOOLS[0]["function"]["parameters"])
    assert result.tool_result == module.stock_level(result.call_arguments["city"])
    assert "<tool" not in result.answer and result.tool_result in result.answer, result.answer
    assert result.ok  # what makes the example exit 0 (before: a <tool_call> block as content)


def test_tool_choice_none_never_returns_call_markup(make_real_app):
    """Tools given, tool_choice none (OpenAI) / {"type": "none"} (Anthropic), after a call and
    its result (the example's second step): the model, shown the tools, writes a call again
    (before: `<tool_call>...</tool_call>` or a spelling of its own as content); now the answer
    is text without markup, streamed and whole, and no call."""
    app = make_real_app()
    extra = {"cache_salt": salt()}
    args = '{"city": "Paris"}'
    history = [{"role": "system", "content": "You are a store assistant. Use the tools."},
               {"role": "user", "content": "What's the weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": args}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    claude_history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "18 degrees, sunny"}]}]
    with serve(app) as server:
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        body = dict(model=MODEL, messages=history, tools=OPENAI_TOOLS, tool_choice="none",
                    max_tokens=40, temperature=0, extra_body=extra)
        whole = oai.chat.completions.create(**body).choices[0]
        chunks = list(oai.chat.completions.create(**body, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ask = dict(model=MODEL, system=history[0]["content"], messages=claude_history,
                   tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}, max_tokens=40,
                   extra_body={**extra, "temperature": 0})
        answer = claude.messages.create(**ask)
        with claude.messages.stream(**ask) as stream:
            claude_streamed = "".join(stream.text_stream)
        oai.close()
        claude.close()
    assert not whole.message.tool_calls and whole.finish_reason != "tool_calls"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason != "tool_use"
    texts = [whole.message.content or "", streamed, answer.content[0].text, claude_streamed]
    for text in texts:
        assert text.strip() and "<tool" not in text and not text.lstrip().startswith("<"), text
    assert streamed == texts[0] and claude_streamed == texts[2]


def test_a_function_without_parameters_is_called_with_no_arguments(make_real_app):
    """OpenAI's reference: "Omitting `parameters` defines a function with an empty parameter
    list". A forced call of such a tool has the arguments `{}` (before: any object, e.g.
    `{"function": {"description": ..., "type": "function"}}`, which a client's zero-argument
    function cannot take)."""
    ping = {"type": "function", "function": {"name": "ping", "description": "Ping the server"}}
    with serve(make_real_app()) as server, openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0
    ) as client:
        whole = client.chat.completions.create(
            model=MODEL, messages=messages("Is the server up?"), tools=[ping],
            tool_choice="required", max_tokens=24, temperature=0,
            extra_body={"cache_salt": salt()})
    calls = whole.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("ping", {})]
    assert whole.choices[0].finish_reason == "tool_calls"


def test_a_pydantic_tool_with_a_nested_model_is_called(make_real_app):
    """The SDK's `pydantic_function_tool` of a model with a nested model writes `$defs` and
    `$ref`s, as agent frameworks do: the forced call validates as that model (the SDK parses
    it into `parsed_arguments`); before, every such request was a 400 (the refs named
    nothing once the schema sat inside the call's schema)."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str

    class Forecast(BaseModel):
        city: City

    tool = openai.pydantic_function_tool(Forecast, name="forecast")
    assert "$defs" in tool["function"]["parameters"]  # what makes this case
    with serve(make_real_app()) as server, openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0
    ) as client:
        whole = client.chat.completions.parse(
            model=MODEL, messages=messages("What's the forecast for Paris?"), tools=[tool],
            tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0,
            extra_body={"cache_salt": salt()})
    calls = whole.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["forecast"]
    assert isinstance(calls[0].function.parsed_arguments, Forecast)


async def test_a_grammar_past_the_matchers_limits_is_the_clients_400(make_real_app):
    """A json_schema `anyOf` of 3,000 objects compiles, but llguidance's parser refuses it at
    the first token ("Current row has 3000 items; max is 2000"): that was a 500 'engine error'
    after ~5 s, as if the engine had failed. The schema is the client's, so it is a 400 that
    says the grammar could not be followed; the engine serves the next request as usual."""
    app = make_real_app()
    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}": {
        "type": "string", "pattern": f"x{i}[a-z]{{3,9}}"}}, "required": [f"k{i}"]}
        for i in range(3000)]}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}
    with serve(app) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model=MODEL, messages=messages("Pick one."), response_format=fmt,
                max_tokens=8, temperature=0, extra_body={"cache_salt": salt()})
        after = await client.chat.completions.create(
            model=MODEL, messages=messages("Say hi."), max_tokens=4, temperature=0)
        await client.close()
    assert err.value.status_code == 400
    assert "could not be followed" in err.value.body["message"]
    assert after.choices[0].message.content
