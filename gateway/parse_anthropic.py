"""Anthropic Messages bodies (/v1/messages) -> ChatRequest with OpenAI-shaped messages.

Conversion to the neutral (OpenAI) shape:
- `system` (string or text blocks) -> one leading system message (blocks joined by "\\n");
- user `tool_result` blocks -> `tool` messages (tool_call_id = tool_use_id), in block order,
  with the user's remaining text after them;
- assistant `tool_use` blocks -> `tool_calls` ({"id", "type": "function",
  "function": {"name", "arguments": JSON text of input}});
- assistant `thinking` / `redacted_thinking` blocks are accepted and left out of the neutral
  messages (the engine's and an OpenAI-compatible upstream's model did not write them); an
  Anthropic upstream is sent the client's body, so it gets them unchanged;
- for an upstream, user `image` and `document` blocks (in a message or a tool_result; their
  sources checked as Anthropic checks them) -> an image from base64 or a URL as OpenAI's
  image_url part (a data URL for base64), any other as it came, with the message's content a
  list of parts (an Anthropic upstream gets the client's body itself; an OpenAI-compatible one
  refuses what it cannot carry); the embedded model reads only text: a 400 naming the block;
- tools {name, description, input_schema} -> {"type": "function", "function": {..., "parameters"}};
- consecutive messages of one role -> one message, as Anthropic combines them into one turn
  (`gateway.anthropic_turns`); a final assistant message stays last: the start of the answer,
  which the embedded engine continues.
Sampling: temperature, top_p, top_k and stop_sequences go into `SamplingOptions`.
`output_config.format` ({"type": "json_schema", "schema"}) constrains the answer to one JSON
document, as OpenAI's `response_format` does; `output_config.effort` is checked and taken as a
hint. `thinking` enabled / between_tools is a 400 for the embedded engine (the model does not
think); disabled and adaptive are accepted, and an upstream gets any valid type.
`cache_control` is accepted on any block and ignored (the engine caches every full page).
Checked as Anthropic checks them: content is never empty except a final assistant message's
(whose text may not end with whitespace), no text block in a message is empty, every tool has
an `input_schema` object and a name of its own (letters, digits, `_`, `-`), `stop_sequences`
is an array of strings, and (for the embedded engine) each tool_result answers a tool_use of
the previous message, each tool_use is answered in the next one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.anthropic_media import MEDIA_SOURCES, media_block
from gateway.anthropic_turns import check_prefill_end, is_prefilled, merge_turns
from gateway.errors import invalid
from gateway.structured import (
    ToolChoice,
    ToolMode,
    build_constraint,
    check_named_tool,
    document_schema,
    tool_schemas,
)
from gateway.types import ChatRequest, OutputConstraint, SamplingOptions
from gateway.validate import (
    ParseContext,
    check_model,
    check_tool_schema,
    namespace_for,
    opt_bool,
    opt_dict,
    opt_int,
    opt_list,
    opt_number,
    opt_str,
    req_list,
    stop_strings,
    tool_round_trip_break,
)


def parse_messages(body: dict[str, Any], ctx: ParseContext) -> ChatRequest:
    """A validated Anthropic request; raises GatewayError naming the bad field."""
    model = check_model(body, ctx)
    max_tokens = opt_int(body, "max_tokens", low=0)  # 0: pre-warm the cache, answer nothing
    if max_tokens is None:
        raise invalid("'max_tokens' is required (an integer >= 0)", "max_tokens")
    messages = _system(body.get("system"))
    origins = [-1] * len(messages)  # the index in `messages` of the body each one comes from
    given = req_list(body, "messages")
    for i, msg in enumerate(given):
        for converted in _message(msg, i, final=i == len(given) - 1, media=not ctx.embedded):
            if messages and merge_turns(messages[-1], converted):
                continue
            messages.append(converted)
            origins.append(i)
    tools = tuple(_tool(t, i) for i, t in enumerate(opt_list(body, "tools")))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise invalid("'tools' names a tool twice (tool names must be unique)", "tools")
    document = _output_format(body, ctx.grammar)
    constraint = _constraint(body.get("tool_choice"), tools, document, ctx.grammar)
    if document is not None and is_prefilled(messages, given):
        raise invalid("'output_config.format' cannot be combined with a final assistant "
                      "message (a prefill): the answer must be one whole JSON document",
                      f"messages[{len(given) - 1}]")
    _thinking(body, ctx.embedded)
    if ctx.embedded:
        _check_round_trips(messages, origins)
    metadata = opt_dict(body, "metadata") or {}
    if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
        raise invalid("'metadata.user_id' must be a string", "metadata.user_id")
    options = SamplingOptions(
        max_tokens=max_tokens,
        temperature=opt_number(body, "temperature", 0.0, 1.0),
        top_p=opt_number(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=opt_int(body, "top_k", low=1),
        stop=stop_strings(body.get("stop_sequences"), "stop_sequences", 16, single=False),
    )
    return ChatRequest(
        request_id=ctx.request_id,
        provider="anthropic",
        model=model,
        messages=tuple(messages),
        tools=tools,
        options=options,
        stream=opt_bool(body, "stream"),
        tenant=ctx.tenant,
        namespace=namespace_for(ctx.tenant, opt_str(body, "cache_salt")),
        body=body,
        constraint=constraint,
    )


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise invalid("'system' must be a string or an array of text blocks", "system")
    texts = [_text_block(block, f"system[{i}]") for i, block in enumerate(system)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _text_block(block: Any, path: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        got = f" (got a {kind!r} block)" if isinstance(kind, str) else ""
        raise invalid(f"'{path}' must be a text block: only text is supported{got}", path)
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"'{path}.text' must be a string", f"{path}.text")
    return text


def _message_text(block: Any, path: str) -> str:
    """A message's text block, whose text is never empty (Anthropic: "text content blocks must
    be non-empty")."""
    text = _text_block(block, path)
    if not text:
        raise invalid(f"'{path}.text' must not be empty (text content blocks must be "
                      "non-empty)", f"{path}.text")
    return text


def _message(msg: Any, i: int, *, final: bool, media: bool = False) -> list[dict[str, Any]]:
    path = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise invalid(f"'{path}' must be an object", path)
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"'{path}.role' must be 'user' or 'assistant'", f"{path}.role")
    content = msg.get("content")
    if (content == "" or content == []) and not (final and role == "assistant"):
        raise invalid(f"'{path}.content' must not be empty (only a final assistant message, "
                      "the start of the answer, may be)", f"{path}.content")
    if final and role == "assistant":
        check_prefill_end(content, path)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"'{path}.content' must be a string or an array of blocks", f"{path}.content")
    if role == "assistant":
        return [_assistant(content, f"{path}.content")]
    return _user(content, f"{path}.content", media)


def _assistant(blocks: list[Any], path: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            calls.append(_tool_use(block, f"{path}[{j}]"))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            texts.append(_message_text(block, f"{path}[{j}]"))
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


def _tool_use(block: dict[str, Any], path: str) -> dict[str, Any]:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{path}.id' must be a non-empty string", f"{path}.id")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{path}.name' must be a non-empty string", f"{path}.name")
    if not isinstance(args, dict):
        raise invalid(f"'{path}.input' must be an object", f"{path}.input")
    arguments = json.dumps(args, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _user(blocks: list[Any], path: str, media: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            out.append(_tool_result(block, f"{path}[{j}]", media))
        else:
            part = _part(block, f"{path}[{j}]", media)
            if part["type"] == "text":
                _message_text(block, f"{path}[{j}]")
            parts.append(part)
    if parts or not out:
        out.append({"role": "user", "content": _joined(parts)})
    return out


def _part(block: Any, path: str, media: bool) -> dict[str, Any]:
    """A user block as a neutral (OpenAI) part: text, and for an upstream (`media`) an image
    or a document (`_media_block`)."""
    if media and isinstance(block, dict) and block.get("type") in MEDIA_SOURCES:
        return media_block(block, path)
    return {"type": "text", "text": _text_block(block, path)}


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Neutral content: text parts joined into one string, one a line (so a client's
    `<system-reminder>` block and its question stay apart, as vLLM joins parts), or, when
    there is an image or a document, the parts themselves."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _tool_result(block: dict[str, Any], path: str, media: bool = False) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{path}.tool_use_id' must be a non-empty string", f"{path}.tool_use_id")
    content: str | list[dict[str, Any]] = ""
    given = block.get("content", "")
    if isinstance(given, list):
        content = _joined([_part(b, f"{path}.content[{k}]", media)
                           for k, b in enumerate(given)])
    elif isinstance(given, str):
        content = given
    else:
        raise invalid(f"'{path}.content' must be a string or text blocks", f"{path}.content")
    if block.get("is_error"):
        content = f"[error] {content}" if isinstance(content, str) else \
            [{"type": "text", "text": "[error] "}, *content]
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _check_round_trips(messages: list[dict[str, Any]], origins: list[int]) -> None:
    """A broken tool round trip (`tool_round_trip_break`) as Anthropic names it: a
    tool_result answering no tool_use block of the message before, or a tool_use block the
    next message does not answer (`origins`: each chat message's index in the body)."""
    broken = tool_round_trip_break(messages)
    if broken is None:
        return
    i, call_id = broken
    path = f"messages[{origins[i]}].content"
    if messages[i]["role"] == "tool":
        raise invalid(f"'{path}' has a tool_result for {call_id!r}, which answers no tool_use "
                      "block of the previous message", path)
    raise invalid(f"'{path}' has a tool_use block {call_id!r} with no tool_result in the next "
                  "message: each tool_use must be answered there", path)


#: the tool names Anthropic takes
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")


def _tool(tool: Any, i: int) -> dict[str, Any]:
    path = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise invalid(f"'{path}' must be an object", path)
    if tool.get("type") not in (None, "custom"):
        raise invalid(f"'{path}.type' {tool.get('type')!r} is not supported", f"{path}.type")
    check_tool_schema(tool, path, "input_schema")
    if not TOOL_NAME.fullmatch(tool["name"]):
        raise invalid(f"'{path}.name' must be 1 to 128 letters, digits, '_' or '-' (got "
                      f"{tool['name']!r})", f"{path}.name")
    if not isinstance(tool.get("input_schema"), dict):
        raise invalid(f"'{path}.input_schema' is required (a JSON schema object)",
                      f"{path}.input_schema")
    fn: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    fn["parameters"] = tool["input_schema"] or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _constraint(choice: Any, tools: tuple[dict[str, Any], ...], document: dict[str, Any] | None,
                grammar: bool) -> OutputConstraint | None:
    """The output grammar of tools + tool_choice + the output format's document schema (400s
    name the field); none without `grammar` (an upstream's request: the fields are still
    checked)."""
    schemas = tool_schemas(tools, [f"tools[{i}].input_schema" for i in range(len(tools))])
    parsed = _tool_choice(choice, bool(tools))
    if parsed.name is not None:
        check_named_tool(parsed.name, schemas, "tool_choice.name")
    return build_constraint(schemas, parsed, document, grammar)


EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _output_format(body: dict[str, Any], grammar: bool) -> dict[str, Any] | None:
    """The JSON document schema of `output_config.format` ({"type": "json_schema", "schema":
    {...}}, Anthropic's structured outputs), or None. `output_config.effort` is checked and
    taken as a hint: the embedded model has one way of answering."""
    config = opt_dict(body, "output_config")
    if config is None:
        return None
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'output_config.effort' must be one of {', '.join(EFFORTS)}",
                      "output_config.effort")
    fmt = opt_dict(config, "format", "output_config.format")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise invalid("'output_config.format.type' must be 'json_schema'",
                      "output_config.format.type")
    path = "output_config.format.schema"
    if not isinstance(fmt.get("schema"), dict):
        raise invalid(f"'{path}' is required (a JSON schema object)", path)
    return document_schema(fmt["schema"], path, grammar)


THINKING = ("enabled", "disabled", "adaptive", "between_tools")


def _thinking(body: dict[str, Any], embedded: bool) -> None:
    """`thinking`: an upstream model may think; the embedded one cannot, so asking it to
    (enabled, between_tools) is a 400. Disabled and adaptive (the model decides, and it
    decides not to) are served as they are."""
    thinking = opt_dict(body, "thinking")
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in THINKING:
        raise invalid(f"'thinking.type' must be one of {', '.join(THINKING)}", "thinking.type")
    if embedded and kind in ("enabled", "between_tools"):
        raise invalid(f"'thinking' of type {kind!r} is not supported: the model does not think "
                      "before it answers (disabled or adaptive is accepted)", "thinking")


_ANTHROPIC_MODES: dict[str, ToolMode] = {"auto": "auto", "any": "required", "none": "none"}


def _tool_choice(choice: Any, has_tools: bool) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if has_tools else "none")
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
    single = choice.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise invalid("'tool_choice.disable_parallel_tool_use' must be a boolean",
                      "tool_choice.disable_parallel_tool_use")
    kind, parallel = choice["type"], not single
    if kind in ("any", "tool") and not has_tools:
        raise invalid(f"'tool_choice.type' is {kind!r} but 'tools' is empty", "tool_choice.type")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise invalid("'tool_choice.name' must be a non-empty string", "tool_choice.name")
        return ToolChoice("required", name, parallel)
    return ToolChoice(_ANTHROPIC_MODES[kind], None, parallel)
