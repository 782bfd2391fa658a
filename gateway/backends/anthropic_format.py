"""Anthropic Messages bodies for the Anthropic upstream: conversion and cache breakpoints.

`to_anthropic_body` re-expresses a neutral (OpenAI-shaped) `ChatRequest` as a Messages body;
tool_choice and parallel_tool_calls become its tool_choice, response_format json_schema its
output_config format; an OpenAI field the Messages API has no place for (`best_of` > 1, a
`suffix`, a non-empty `logit_bias`, repetition penalties, json_object, the legacy `functions` /
`function_call`) is a 400 naming it, never
a silent drop (`seed`, a best-effort hint in OpenAI's own API, is dropped). A user message's
image_url parts become image blocks and an inline PDF file part a document block; audio and
other files are a 400 naming the part.
`place_cache_breakpoints` adds `cache_control` markers at the stable boundary: the end of the
history before the last user turn (prompt_lint's rewriter moves dynamic spans into that turn),
then the end of the system prompt, then the last tool. The client's own markers are kept and
the total never exceeds Anthropic's limit of 4.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.parse_openai import LEGACY_FUNCTION_FIELDS
from gateway.types import BackendError, ChatRequest

MAX_BREAKPOINTS = 4
DEFAULT_MAX_TOKENS = 1024
EPHEMERAL = {"type": "ephemeral"}
_NO_CACHE_CONTROL = {"thinking", "redacted_thinking"}


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("refusal" if p.get("type") == "refusal" else "text", ""))
                       for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _image_block(part: dict[str, Any]) -> dict[str, Any]:
    """An image_url part (checked by the parser: an http(s) URL or a base64 data URL) as an
    image block; its `detail`, a hint with no Messages field, is dropped."""
    url = str(part["image_url"]["url"])
    if url.startswith("data:"):
        media, data = url[5:].split(";base64,", 1)
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


PDF_DATA_URL = "data:application/pdf;base64,"


def _file_block(part: dict[str, Any], path: str) -> dict[str, Any]:
    """A file part as a document block: a PDF sent inline (file_data, a base64 data URL), what
    the Messages API reads as a base64 document; a file id or another kind of file is a 400."""
    data = part["file"].get("file_data")
    if not isinstance(data, str) or not data.startswith(PDF_DATA_URL):
        raise BackendError(400, f"'{path}' is not supported by an Anthropic upstream: it takes "
                           "a file only as an inline PDF (file_data "
                           f"'{PDF_DATA_URL}...'), not by file id or of another type",
                           kind="invalid_request_error", param=path)
    return {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                           "data": data[len(PDF_DATA_URL):]}}


def _user_content(content: Any, path: str) -> str | list[dict[str, Any]]:
    """A user message's content as Messages content: text, images and inline PDFs; audio is a
    400 naming the part (the Messages API takes none)."""
    if not isinstance(content, list):
        return _text_of(content)
    blocks: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "text":
            blocks.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":
            blocks.append(_image_block(part))
        elif kind == "file":
            blocks.append(_file_block(part, f"{path}[{j}]"))
        else:
            raise BackendError(400, f"'{path}[{j}]' is not supported by an Anthropic upstream: "
                               f"the Messages API takes no {kind} parts",
                               kind="invalid_request_error", param=f"{path}[{j}]")
    return blocks


def _assistant_content(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    text = _text_of(message.get("content")) or str(message.get("refusal") or "")
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {"arguments": fn.get("arguments")}
        blocks.append({"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""),
                       "input": args if isinstance(args, dict) else {"value": args}})
    return blocks


def _convert_messages(
    messages: tuple[dict[str, Any], ...],
) -> tuple[list[str], list[dict[str, Any]]]:
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text_of(m.get("content")))
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": str(m.get("tool_call_id", "")),
                     "content": _text_of(m.get("content"))}
            last = out[-1] if out else None
            if last and last["role"] == "user" and isinstance(last["content"], list) and all(
                    b.get("type") == "tool_result" for b in last["content"]):
                last["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_content(m)})
        else:
            out.append({"role": "user",
                        "content": _user_content(m.get("content"), f"messages[{i}].content")})
    return system, out


def _unsupported(name: str, why: str) -> BackendError:
    return BackendError(400, f"'{name}' is not supported by an Anthropic upstream: {why}",
                        kind="invalid_request_error", param=name)


def check_carried(body: dict[str, Any]) -> None:
    """400 for an OpenAI body's field that a Messages body cannot carry (the parser has
    checked the fields' shapes). `seed` alone is dropped: OpenAI's own API takes it as a
    best-effort hint, and a Messages body has none."""
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of", "it samples one answer")
    if body.get("suffix"):
        raise _unsupported("suffix", "it cannot insert before a suffix")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "the Messages API has no token biases")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise _unsupported(name, "the Messages API has no repetition penalties")
    if (body.get("response_format") or {}).get("type") == "json_object":
        raise _unsupported("response_format", "it takes a JSON schema (type json_schema), "
                                              "not json_object")
    for name, replacement in LEGACY_FUNCTION_FIELDS:
        if body.get(name) not in (None, []):
            raise _unsupported(name, f"send '{replacement}' instead")


def _tool_choice(body: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's tool_choice and parallel_tool_calls as a Messages tool_choice (None: the
    default, auto with parallel calls)."""
    choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    if isinstance(choice, dict):
        out: dict[str, Any] = {"type": "tool", "name": choice["function"]["name"]}
    elif choice in ("required", "none"):
        out = {"type": "any" if choice == "required" else "none"}
    elif parallel is False:
        out = {"type": "auto"}
    else:
        return None
    if parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


def _output_config(body: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format json_schema as a Messages output_config format."""
    fmt = body.get("response_format") or {}
    if fmt.get("type") != "json_schema":
        return None
    return {"format": {"type": "json_schema", "schema": fmt["json_schema"].get("schema") or {}}}


def to_anthropic_body(req: ChatRequest) -> dict[str, Any]:
    """A Messages API body for a request that arrived in OpenAI format."""
    check_carried(req.body)
    if req.prompt is not None:
        system: list[str] = []
        messages: list[dict[str, Any]] = [{"role": "user", "content": req.prompt}]
    else:
        system, messages = _convert_messages(req.messages)
    o = req.options
    body: dict[str, Any] = {"model": req.model, "messages": messages,
                            "max_tokens": o.max_tokens or DEFAULT_MAX_TOKENS}
    if system:
        body["system"] = "\n\n".join(system)
    if req.tools:
        body["tools"] = [{
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "input_schema": t["function"].get("parameters") or {"type": "object", "properties": {}},
        } for t in req.tools]
        body["tool_choice"] = _tool_choice(req.body)
    extra = {"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k,
             "stop_sequences": list(o.stop) or None, "output_config": _output_config(req.body)}
    body.update({k: v for k, v in extra.items() if v is not None})
    if body.get("tool_choice") is None:
        body.pop("tool_choice", None)
    return body


def _blocks(container: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The block list at container[key], owned by `container`: a plain string becomes one
    text block, a list is copied with its last block (the one a marker may be put on), so the
    caller's body is never changed (copy on write instead of a deep copy of the whole body)."""
    value = container.get(key)
    if isinstance(value, str) and value:
        container[key] = value = [{"type": "text", "text": value}]
    elif isinstance(value, list):
        container[key] = value = _own_last(value)
    return value if isinstance(value, list) else []


def _own_last(items: list[Any]) -> list[Any]:
    """A copy of `items` whose last element, when a dict, is a copy too."""
    out = list(items)
    if out and isinstance(out[-1], dict):
        out[-1] = dict(out[-1])
    return out


def count_breakpoints(body: dict[str, Any]) -> int:
    """Number of `cache_control` markers already in tools, system and messages."""
    def count(items: Any) -> int:
        if not isinstance(items, list):
            return 0
        return sum(1 for b in items if isinstance(b, dict) and "cache_control" in b)
    total = count(body.get("tools")) + count(body.get("system"))
    return total + sum(count(m.get("content")) for m in body.get("messages") or ())


def _markable(block: dict[str, Any] | None) -> bool:
    if block is None or "cache_control" in block or block.get("type") in _NO_CACHE_CONTROL:
        return False
    return not (block.get("type") == "text" and not block.get("text"))


def _history_end(body: dict[str, Any]) -> dict[str, Any] | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users or users[-1] == 0:
        return None
    k = users[-1] - 1
    messages[k] = message = dict(messages[k])  # `messages` is already the output's own list
    blocks = _blocks(message, "content")
    return blocks[-1] if blocks else None


def _system_end(body: dict[str, Any]) -> dict[str, Any] | None:
    if not body.get("system"):
        return None
    blocks = _blocks(body, "system")
    return blocks[-1] if blocks else None


def _tools_end(body: dict[str, Any]) -> dict[str, Any] | None:
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    body["tools"] = tools = _own_last(tools)
    last: dict[str, Any] | None = tools[-1]
    return last


def place_cache_breakpoints(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of `body` with `cache_control` at the stable boundary (at most 4 in total)."""
    out = dict(body)
    if isinstance(out.get("messages"), list):
        out["messages"] = list(out["messages"])  # the finders replace the message they mark
    budget = MAX_BREAKPOINTS - count_breakpoints(out)
    for find in (_history_end, _system_end, _tools_end):
        if budget <= 0:
            break
        block = find(out)
        if _markable(block):
            block["cache_control"] = dict(EPHEMERAL)  # type: ignore[index]
            budget -= 1
    return out
