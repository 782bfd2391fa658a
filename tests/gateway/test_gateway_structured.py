"""Structured outputs without the model: the grammars `gateway.structured` builds, checked
against hand-written outputs and `jsonschema`; streamed tool calls against `parse_output`; and
400s (in each provider's format) for bad schemas, with nothing reaching the backend."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gguf import read_tokenizer
from engine.gguf_file import GGUFFile
from engine.grammar import GrammarCompiler, GrammarSpec
from engine.loader import default_model_path
from engine.tokenizer import Tokenizer
from gateway.structured import ToolChoice, ToolSchema, tool_grammar
from gateway.tool_calls import CLOSE, OPEN, parse_output
from gateway.tool_stream import ToolCallStream, streamed_calls

from .gateway_fakes import FAKE_MODEL, asgi_client

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [ToolSchema("get_weather", WEATHER, "p0"), ToolSchema("add", ADD, "p1")]


def call(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = Tokenizer(read_tokenizer(GGUFFile(default_model_path()), "smollm2"))
    return GrammarCompiler(tok, sorted(tok.spec.special))


def accepts(compiler: GrammarCompiler, grammar: str, text: str) -> bool:
    """Reference check: feed the text's tokens; the grammar must take all and be complete."""
    state = compiler.new_state(GrammarSpec("lark", grammar))
    tokens = compiler._vocab.encode(text)
    return all(state.accept(t) for t in tokens) and state.is_accepting


REQUIRED = [
    (call("get_weather", {"city": "Paris"}), True),
    (call("add", {"a": 1, "b": 2}) + call("get_weather", {"city": "Oslo"}), True),
    ("Sure. " + call("add", {"a": 1, "b": 2}), False),  # text before a forced call
    (call("add", {"a": "1", "b": 2}), False),  # arguments violate the schema
    (call("get_weather", {"town": "Paris"}), False),  # unknown property
    (call("send_email", {"to": "x"}), False),  # not a tool
    ("The weather is nice.", False),
]


@pytest.mark.parametrize(("text", "valid"), REQUIRED)
def test_required_grammar_matches_schema_validation(compiler, text, valid):
    grammar = tool_grammar(TOOLS, ToolChoice("required"))
    assert grammar is not None
    assert accepts(compiler, grammar, text) == valid
    if valid:  # independent reference: every parsed call validates with jsonschema
        schemas = {t.name: t.schema for t in TOOLS}
        for c in parse_output(text, "r").tool_calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]),
                                schemas[c["function"]["name"]])


#: what pydantic writes for a nested model (the SDK's `pydantic_function_tool`, agent
#: frameworks): `$defs` at the schema's root and `$ref`s to them; and a ref to the root itself
NESTED = {"$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}},
          "type": "object", "properties": {"to": {"$ref": "#/$defs/Loc"}},
          "required": ["to"], "additionalProperties": False}
TREE = {"type": "object", "properties": {"name": {"type": "string"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name", "kids"], "additionalProperties": False}


@pytest.mark.parametrize(("schema", "good", "bad"), [
    (NESTED, {"to": {"city": "Oslo"}}, {"to": {"town": "Oslo"}}),
    (TREE, {"name": "a", "kids": [{"name": "b", "kids": []}]}, {"name": "a", "kids": [{}]}),
])
def test_tool_schemas_with_refs_constrain_their_calls(compiler, schema, good, bad):
    """A tool schema's `$ref`s point into that schema: a forced call of it is constrained by
    it (before, the schema sat inside the call's own schema, so `#/$defs/Loc` named nothing
    and every such request was a 400 with the grammar's text)."""
    jsonschema.validate(good, schema)  # the reference: jsonschema's reading of the schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    grammar = tool_grammar([ToolSchema("go", schema, "p0")], ToolChoice("required"))
    assert grammar is not None
    assert accepts(compiler, grammar, call("go", good))
    assert not accepts(compiler, grammar, call("go", bad))


def test_named_and_single_call_choices(compiler):
    named = tool_grammar(TOOLS, ToolChoice("required", "add"))
    assert named is not None
    assert accepts(compiler, named, call("add", {"a": 1, "b": 2}))
    assert not accepts(compiler, named, call("get_weather", {"city": "Paris"}))
    single = tool_grammar(TOOLS, ToolChoice("required", parallel=False))
    assert single is not None
    two = call("add", {"a": 1, "b": 2}) + call("add", {"a": 3, "b": 4})
    assert accepts(compiler, single, call("add", {"a": 1, "b": 2}))
    assert not accepts(compiler, single, two)


def test_auto_allows_text_but_constrains_an_opened_call(compiler):
    grammar = tool_grammar(TOOLS, ToolChoice("auto"))
    assert grammar is not None
    assert accepts(compiler, grammar, "Hello! How can I help?")
    assert accepts(compiler, grammar, "Let me check. " + call("get_weather", {"city": "Rome"}))
    assert not accepts(compiler, grammar, "Let me check. <tool_call>\n{\"city\": \"Rome\"}")


def test_none_with_tools_allows_text_but_never_call_markup(compiler):
    """tool_choice none with tools: text (SmolLM2 has no `<tool_call>` token to ban), but never
    a `<tool` tag nor a leading tag, so call markup cannot come back as content."""
    assert "<tool_call>" not in compiler._vocab.spec.tokens  # five ordinary tokens
    grammar = tool_grammar(TOOLS, ToolChoice("none"))
    assert grammar is not None
    assert accepts(compiler, grammar, "Hello! It is 42 degrees in Rome.\n")
    assert accepts(compiler, grammar, "Use x < y or <b>bold</b>; a <tol> b\n{}")
    assert not accepts(compiler, grammar, call("get_weather", {"city": "Rome"}))
    assert not accepts(compiler, grammar, "Sure. <tool_call>")
    assert not accepts(compiler, grammar, "done</tool_call>")
    assert not accepts(compiler, grammar, '3 <tool_call id="1" name="add" />')
    assert not accepts(compiler, grammar, "<tool_check>{}</tool_check>")  # invented spelling
    assert not accepts(compiler, grammar, "\n <answer>42</answer>")  # a leading tag
    assert tool_grammar([], ToolChoice("none")) is None  # no tools: unconstrained


def test_response_document_grammar(compiler):
    grammar = tool_grammar([], ToolChoice("none"), ADD)
    assert grammar is not None
    assert accepts(compiler, grammar, '{"a": 1, "b": 2}')
    assert not accepts(compiler, grammar, '{"a": 1}')
    assert not accepts(compiler, grammar, 'Here: {"a": 1, "b": 2}')


STREAM_TEXT = ("Checking. " + call("get_weather", {"city": 'Pa"ris}{'}) + "\n"
               + call("add", {"a": 1, "b": [2, {"c": "]"}]})
               + '<tool_call>{"name": "add", "arguments":  \n {"a":1,  "b": [2.50, "é\\u00e9"]} }'
               + "</tool_call>")  # spaced and written as no JSON encoder writes it


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, len(STREAM_TEXT) - 1), max_size=12, unique=True))
def test_stream_pieces_reassemble_to_parsed_calls(cuts):
    """Any split of the output streams to the calls `parse_output` finds in the whole text."""
    bounds = [0, *sorted(cuts), len(STREAM_TEXT)]
    stream, pieces, visible = ToolCallStream("rid"), [], ""
    for start, end in zip(bounds, bounds[1:], strict=False):
        text, calls = stream.feed(STREAM_TEXT[start:end])
        visible += text
        pieces += calls
    tail, parsed = stream.finish(STREAM_TEXT)
    reference = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]
    assert len(reference) == 3
    assert streamed_calls(pieces) == reference  # the same strings, byte for byte
    assert reference[2][1] == '{"a":1,  "b": [2.50, "é\\u00e9"]}'  # as the model wrote it
    assert [p.id for p in pieces if p.id] == [c["id"] for c in parsed.tool_calls]
    assert (visible + tail).rstrip() == parsed.text == "Checking."


@settings(max_examples=80, deadline=None)
@given(st.integers(len("Checking. <tool_call>"), len(STREAM_TEXT) - 1),
       st.lists(st.integers(1, 9), max_size=10))
def test_output_cut_inside_a_call_is_never_sent_as_text(end, cuts):
    """Output cut by max_tokens at any point inside the calls: no raw block ever follows as
    text, whether or not the cut call's pieces were streamed (the stream and the final answer
    agree: the complete calls only, then finish_reason "length")."""
    text, stream, pieces, visible, at = STREAM_TEXT[:end], ToolCallStream("rid"), [], "", 0
    for cut in [*cuts, len(text)]:
        piece, at = text[at : at + cut], at + cut
        shown, calls = stream.feed(piece)
        visible, pieces = visible + shown, pieces + calls
    tail, parsed = stream.finish(text)
    complete = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in parsed.tool_calls]
    assert OPEN not in visible + tail
    assert (visible + tail).rstrip() == parsed.text == "Checking."
    streamed = streamed_calls(pieces)
    assert [n for n, _ in streamed[: len(complete)]] == [n for n, _ in complete]
    if not pieces:  # cut before the first call's head: nothing was sent as a call
        assert complete == []
    assert STREAM_TEXT[:end].count(CLOSE) <= len(complete) <= text.count(OPEN)  # closed ones kept


# ------------------------------------------------------------------ 400s, nothing reaches engine

BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "string", "format": "bogus"}}}
UNSUPPORTED = {"type": "object", "dependentSchemas": {"x": {}}}


def openai_client(app: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none",
                              http_client=asgi_client(app), max_retries=0)


OPENAI_BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
     "tools[0].function.parameters", "bogus"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": UNSUPPORTED}}]},
     "tools[0].function.parameters", "dependentSchemas"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": UNSUPPORTED}}},
     "response_format.json_schema.schema", "dependentSchemas"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    # OpenAI's reference: `name` is required, a-z, A-Z, 0-9, _ and -, at most 64 characters
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": WEATHER}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "my schema", "schema": WEATHER}}},
     "response_format.json_schema.name", "64"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name", "'g'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict", "boolean"),
]


@pytest.mark.parametrize(("extra", "param", "words"), OPENAI_BAD)
async def test_openai_bad_structured_fields_are_400s(make_fake_app, fake_backend, extra, param,
                                                     words):
    client = openai_client(make_fake_app())
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "hi"}], **extra)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"]
    assert fake_backend.seen == []


ANTHROPIC_BAD = [
    ({"tools": [{"name": "f", "input_schema": UNSUPPORTED}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": BAD_SCHEMA}], "tool_choice": {"type": "any"}},
     "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": WEATHER}],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice.type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": UNSUPPORTED}}},
     "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}},
     "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "xml", "schema": WEATHER}}},
     "output_config.format.type"),
    ({"output_config": {"format": "json"}}, "output_config.format"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": 5}, "output_config"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"thinking": {"type": "between_tools"}}, "thinking"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": True}, "thinking"),
]


@pytest.mark.parametrize(("extra", "param"), ANTHROPIC_BAD)
async def test_anthropic_bad_structured_fields_are_400s(make_fake_app, fake_backend, extra,
                                                        param):
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=make_fake_app()),
                              base_url="http://gateway")
    client = anthropic.AsyncAnthropic(base_url="http://gateway", api_key="none",
                                      http_client=http, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model=FAKE_MODEL, max_tokens=8,
                                     messages=[{"role": "user", "content": "hi"}], **extra)
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert param in body["error"]["message"]
    assert fake_backend.seen == []


async def test_valid_structured_request_carries_its_grammar(make_fake_app, fake_backend):
    client = openai_client(make_fake_app())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    await client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools,
        tool_choice="required", parallel_tool_calls=False)
    constraint = fake_backend.seen[0].constraint
    assert constraint is not None and constraint.tool_calls_required
    assert constraint.grammar == tool_grammar(
        [ToolSchema("get_weather", WEATHER, "")], ToolChoice("required", parallel=False))


async def test_anthropic_output_format_is_a_json_document_grammar(make_fake_app, fake_backend):
    """output_config.format json_schema constrains the answer as OpenAI's response_format
    does (it was ignored: free text came back); thinking off or adaptive and an effort hint
    are accepted (the model never thinks; adaptive lets it decide not to)."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=make_fake_app()),
                              base_url="http://gateway")
    client = anthropic.AsyncAnthropic(base_url="http://gateway", api_key="none",
                                      http_client=http, max_retries=0)
    fmt = {"type": "json_schema", "schema": WEATHER}
    for extra in ({"thinking": {"type": "disabled"}}, {"thinking": {"type": "adaptive"}},
                  {"output_config": {"effort": "low", "format": fmt}}):
        await client.messages.create(model=FAKE_MODEL, max_tokens=8,
                                     messages=[{"role": "user", "content": "hi"}],
                                     **{"output_config": {"format": fmt}, **extra})
        constraint = fake_backend.seen[-1].constraint
        assert constraint is not None and constraint.json_document
        assert constraint.grammar == tool_grammar([], ToolChoice("none"), WEATHER)
    await client.messages.create(
        model=FAKE_MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
        tools=[{"name": "add", "input_schema": ADD}],
        output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    assert fake_backend.seen[-1].constraint.grammar == tool_grammar(
        [ToolSchema("add", ADD, "")], ToolChoice("auto"), WEATHER)
