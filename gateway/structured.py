"""Structured outputs: tool_choice, parallel tool calls and response_format -> one grammar.

The embedded engine constrains its output with an llguidance Lark grammar built here (upstream
providers get the fields in the body and enforce them themselves). Tool calls use the
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` convention of `gateway.tool_calls`:
- "required" (OpenAI) / "any" (Anthropic): one or more calls (exactly one when parallel tool
  calls are off), each an object whose `name` is one of the tools and whose `arguments`
  validate against that tool's schema; a named choice allows only that tool.
- "auto": free text, but once the model writes `<tool_call>` the rest is a valid call.
- "none" with tools given: free text that never contains `<tool` or `</tool` and does not
  open with a tag, so a model shown the tools cannot answer with call markup (in any spelling
  it invents) as content. SmolLM2 spells `<tool_call>` in five ordinary tokens, so there is no
  single token to ban: the text's lexeme excludes the markup instead.
- response_format json_object / json_schema (Anthropic: output_config.format json_schema): the
  answer is one JSON document (with auto tools, a call is the other alternative).
JSON is generated with ", " and ": " separators and no free whitespace (the way the chat
template writes earlier calls), so a small model cannot wander into endless blank space.

Every schema is checked before anything reaches the engine: an invalid schema or a keyword the
grammar engine does not implement is a 400 naming the field (`tools[0].function.parameters`).
A request for an upstream builds no grammar (`ParseContext.grammar`): the provider enforces its
own tools and response formats, and takes keywords the grammar engine does not implement
(`uniqueItems`, `not`, `if`/`then`, any `format`), so its schemas are checked only for being
JSON Schemas (the meta-schema of their draft), as a provider checks them.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from engine.grammar_spec import GrammarError, GrammarSpec, check_grammar
from gateway.errors import invalid
from gateway.types import OutputConstraint
from prompt_lint.memo import LRU, text_bytes

ToolMode = Literal["none", "auto", "required"]
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: tool_choice none with tools: text that does not open with a tag (after blanks) and never
#: writes `<tool`/`</tool` (llguidance's lexeme `&` and `~`): what a call looks like in any
#: spelling the model invents (`<tool_call>`, `<tool_check>`, `<tool_call id=.. />`)
_ANY = "(.|\\n)*"
NO_CALL_GRAMMAR = (f"start: TEXT\nTEXT: /{_ANY}/ & ~/{_ANY}<\\/?tool{_ANY}/"
                   f" & ~/\\s*<{_ANY}/\n")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """tool_choice normalised across providers; `name` set for a named (forced) tool."""

    mode: ToolMode
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """One tool's name and argument schema, with the request path that defined the schema."""

    name: str
    schema: dict[str, Any]
    path: str


#: (grammar, schema JSON) -> its error ("" when valid): 512 schemas and at most 4 MiB of them
#: (a client chooses the schema text, so an entry count alone would not bound the memory).
SCHEMA_MEMO: LRU[tuple[bool, str], str] = LRU(512, max_weight=4 << 20)
_SCHEMA_LOCK = threading.Lock()  # bodies are parsed on the loop and in worker threads


def _schema_error(schema_json: str, grammar: bool) -> str | None:
    key = (grammar, schema_json)
    with _SCHEMA_LOCK:
        found = SCHEMA_MEMO.get(key)
    if found is None:
        found = _grammar_error(schema_json) if grammar else _json_schema_error(schema_json)
        with _SCHEMA_LOCK:
            SCHEMA_MEMO.put(key, found, 2 * text_bytes(schema_json))
    return found or None


def _grammar_error(schema_json: str) -> str:
    """Why the grammar engine cannot constrain output to the schema ("" when it can)."""
    try:
        check_grammar(GrammarSpec("json_schema", schema_json))
    except GrammarError as exc:
        return str(exc).removeprefix("invalid json_schema: ") or "invalid"
    return ""


def _json_schema_error(schema_json: str) -> str:
    """Why the schema is not a JSON Schema ("" when it is): checked against the meta-schema of
    the draft its `$schema` names, else 2020-12's (what providers read tool schemas as)."""
    schema = json.loads(schema_json)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(map(str, exc.absolute_path))
        return f"{exc.message} (at {where})" if where else exc.message
    return ""


def check_schema(schema: dict[str, Any], path: str, grammar: bool = True) -> None:
    """400 naming `path` when the schema is not a JSON Schema or, with `grammar` (for the
    embedded engine), uses what the grammar engine does not implement."""
    error = _schema_error(_sorted_json(schema), grammar)
    if error is not None:
        what = "a supported" if grammar else "a valid"
        raise invalid(f"'{path}' is not {what} JSON schema: {error}", path)


def _sorted_json(schema: dict[str, Any]) -> str:
    """The schema as canonical JSON text (keys sorted), the memo key of its check."""
    try:
        return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # what orjson refuses (integers past 64 bits)
        return json.dumps(schema, sort_keys=True)


def _styled(schema: dict[str, Any]) -> str:
    try:
        return orjson.dumps({**schema, "x-guidance": JSON_STYLE}).decode()
    except TypeError:
        return json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


#: where a tool's schema sits inside its call's schema (`_call_schema`)
ARGUMENTS_POINTER = "#/properties/arguments"


def _call_schema(tool: ToolSchema) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": _rebased(tool.schema)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rebased(value: Any) -> Any:
    """A tool's schema as it sits under the call's `arguments`: every local `$ref` ("#",
    "#/$defs/City": pydantic's nested models) points into it where it now is, not at the
    call schema's root, where nothing of it would be found."""
    if isinstance(value, list):
        return [_rebased(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _rebased(v) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = ARGUMENTS_POINTER + ref[1:]
    return out


def _call_rules(tools: list[ToolSchema], parallel: bool) -> list[str]:
    names = [f"call_{i}" for i in range(len(tools))]
    rules = [f"call_obj: {' | '.join(names)}"]
    rules += [f"{n}: %json {_styled(_call_schema(t))}" for n, t in zip(names, tools, strict=True)]
    rules.append('call_body: "\\n" call_obj "\\n</tool_call>"')
    more = " (\"<tool_call>\" call_body)*" if parallel else ""
    rules.append(f"calls_rest: call_body{more}")
    return rules


def tool_grammar(tools: list[ToolSchema], choice: ToolChoice,
                 document: dict[str, Any] | None = None) -> str | None:
    """The Lark grammar for a request's tools, tool choice and response document schema."""
    if choice.name is not None:
        tools = [t for t in tools if t.name == choice.name]
    use_tools = choice.mode != "none" and bool(tools)
    if not use_tools and document is None and tools:
        return NO_CALL_GRAMMAR
    if not use_tools:
        return None if document is None else f"start: %json {_styled(document)}\n"
    lines = ["%llguidance {}"]
    if choice.mode == "required":
        lines.append('start: "<tool_call>" calls_rest')
    elif document is not None:
        lines += ['start: doc | "<tool_call>" calls_rest', f"doc: %json {_styled(document)}"]
    else:
        lines += ["start: text | opener calls_rest", "text: TEXT", "TEXT: /(.|\\n)*/",
                  'opener[lazy]: TEXT "<tool_call>"']
    return "\n".join(lines + _call_rules(tools, choice.parallel)) + "\n"


def build_constraint(tools: list[ToolSchema], choice: ToolChoice,
                     document: dict[str, Any] | None, grammar: bool = True
                     ) -> OutputConstraint | None:
    """Check every schema (400 naming its field), then the combined grammar; without
    `grammar` (an upstream's request, see `ParseContext.grammar`) only the schemas' validity
    is checked and there is no constraint."""
    for tool in tools:
        check_schema(tool.schema, tool.path, grammar)
    if not grammar:
        return None
    grammar_text = tool_grammar(tools, choice, document)
    if grammar_text is None:
        return None
    forced = choice.mode == "required" and bool(tools)
    return OutputConstraint(grammar=grammar_text, tool_calls_required=forced,
                            json_document=document is not None and not forced)


def tool_schemas(tools: tuple[dict[str, Any], ...], paths: list[str]) -> list[ToolSchema]:
    """ToolSchemas of OpenAI-shaped function tools; `paths` name each tool's schema field."""
    out = []
    for tool, path in zip(tools, paths, strict=True):
        fn = tool["function"]
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append(ToolSchema(fn["name"], schema, path))
    return out


def check_named_tool(name: str, tools: list[ToolSchema], path: str) -> None:
    if name not in {t.name for t in tools}:
        raise invalid(f"'{path}' names tool {name!r}, which is not in 'tools'", path)


def document_schema(schema: Any, path: str, grammar: bool = True) -> dict[str, Any]:
    """A response document's schema (an object, checked as `check_schema` does); 400 naming
    `path` otherwise."""
    if schema is None:
        return dict(ANY_OBJECT)
    if not isinstance(schema, dict):
        raise invalid(f"'{path}' must be an object", path)
    check_schema(schema, path, grammar)
    return schema


__all__ = [
    "ToolChoice",
    "ToolSchema",
    "build_constraint",
    "check_named_tool",
    "check_schema",
    "document_schema",
    "tool_grammar",
    "tool_schemas",
]
