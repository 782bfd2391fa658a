"""Structured outputs: tool_choice, parallel tool calls and response_format -> one grammar.

The embedded engine constrains its output with an llguidance Lark grammar built here (upstream
providers get the fields in the body and enforce them themselves). Tool calls use the
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` convention of `gateway.tool_calls`:
- "required" (OpenAI) / "any" (Anthropic): one or more calls (exactly one when parallel tool
  calls are off), each an object whose `name` is one of the tools and whose `arguments`
  validate against that tool's schema; a named choice allows only that tool.
- "auto": free text, but once the model writes `<tool_call>` the rest is a valid call.
- response_format json_object / json_schema: the answer is one JSON document (with auto tools,
  a call is the other alternative).
JSON is generated with ", " and ": " separators and no free whitespace (the way the chat
template writes earlier calls), so a small model cannot wander into endless blank space.

Every schema is checked before anything reaches the engine: an invalid schema or a keyword the
grammar engine does not implement is a 400 naming the field (`tools[0].function.parameters`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from engine.grammar_spec import GrammarError, GrammarSpec, check_grammar
from gateway.errors import invalid
from gateway.types import OutputConstraint
from prompt_lint.memo import LRU, text_bytes

ToolMode = Literal["none", "auto", "required"]
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


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


#: Schema JSON -> its error ("" when valid): 512 schemas and at most 4 MiB of them (a
#: client chooses the schema text, so an entry count alone would not bound the memory).
SCHEMA_MEMO: LRU[str, str] = LRU(512, max_weight=4 << 20)
_SCHEMA_LOCK = threading.Lock()  # bodies are parsed on the loop and in worker threads


def _schema_error(schema_json: str) -> str | None:
    with _SCHEMA_LOCK:
        found = SCHEMA_MEMO.get(schema_json)
    if found is None:
        found = _check_schema_json(schema_json)
        with _SCHEMA_LOCK:
            SCHEMA_MEMO.put(schema_json, found, 2 * text_bytes(schema_json))
    return found or None


def _check_schema_json(schema_json: str) -> str:
    try:
        check_grammar(GrammarSpec("json_schema", schema_json))
    except GrammarError as exc:
        return str(exc).removeprefix("invalid json_schema: ") or "invalid"
    return ""


def check_schema(schema: dict[str, Any], path: str) -> None:
    """400 naming `path` when the schema is invalid or uses an unsupported keyword."""
    error = _schema_error(_sorted_json(schema))
    if error is not None:
        raise invalid(f"'{path}' is not a supported JSON schema: {error}", path)


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


def _call_schema(tool: ToolSchema) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.schema},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


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
                     document: dict[str, Any] | None) -> OutputConstraint | None:
    """Check every schema (400 naming its field), then the combined grammar."""
    for tool in tools:
        check_schema(tool.schema, tool.path)
    grammar = tool_grammar(tools, choice, document)
    if grammar is None:
        return None
    forced = choice.mode == "required" and bool(tools)
    return OutputConstraint(grammar=grammar, tool_calls_required=forced,
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


def document_schema(schema: Any, path: str) -> dict[str, Any]:
    """A response document's schema (an object), checked; 400 naming `path` otherwise."""
    if schema is None:
        return dict(ANY_OBJECT)
    if not isinstance(schema, dict):
        raise invalid(f"'{path}' must be an object", path)
    check_schema(schema, path)
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
