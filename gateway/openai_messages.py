"""The messages of an OpenAI chat body, checked as OpenAI checks them: roles, content (text
and refusal parts; media parts for an upstream), an assistant's tool calls, a tool message's
`tool_call_id`, and the tool round trips across the conversation. `message` takes the common
valid shapes without building any error path; anything else goes through `checked_message`,
which names the offending field."""

from __future__ import annotations

from typing import Any

from gateway.errors import invalid
from gateway.media_parts import check_media_part
from gateway.validate import tool_round_trip_break

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def message(msg: Any, i: int, media: bool = False) -> dict[str, Any]:
    if isinstance(msg, dict) and msg.get("name") is None:  # the common, valid cases: no
        role = msg.get("role")                              # error paths built
        content = msg.get("content")
        calls = msg.get("tool_calls")
        if type(content) is str and not calls:
            if role in _PLAIN_ROLES:
                return msg
            if role == "tool":
                call_id = msg.get("tool_call_id")
                if type(call_id) is str and call_id:
                    return msg
        elif calls and role == "assistant" and (content is None or type(content) is str) \
                and type(calls) is list and all(map(_plain_call, calls)):
            return msg
    return checked_message(msg, i, media)


def _plain_call(call: Any) -> bool:
    """A tool call `_check_tool_calls` accepts (a function with a name and JSON arguments)."""
    fn = call.get("function") if type(call) is dict else None
    return type(fn) is dict and type(fn.get("name")) is str \
        and type(fn.get("arguments", "")) is str


_PLAIN_ROLES = frozenset({"system", "developer", "user", "assistant"})


def checked_message(msg: Any, i: int, media: bool = False) -> dict[str, Any]:
    path = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise invalid(f"'{path}' must be an object", path)
    role = msg.get("role")
    if role not in ROLES:
        raise invalid(f"'{path}.role' must be one of {sorted(ROLES)}", f"{path}.role")
    content = msg.get("content")
    if role == "assistant":
        _check_assistant(msg, path, media)
    else:
        _check_content(content, f"{path}.content", role if media else None)
    if role == "tool":
        tool_call_id = msg.get("tool_call_id")
        if not isinstance(tool_call_id, str) or not tool_call_id:
            field = f"{path}.tool_call_id"
            raise invalid(f"'{field}' must be a non-empty string", field)
    if msg.get("name") is not None and not isinstance(msg["name"], str):
        raise invalid(f"'{path}.name' must be a string", f"{path}.name")
    return msg


def check_round_trips(messages: tuple[dict[str, Any], ...]) -> None:
    """A broken tool round trip (`tool_round_trip_break`) as OpenAI names it: a tool message
    answering no call, or a call no tool message answers."""
    broken = tool_round_trip_break(messages)
    if broken is None:
        return
    i, call_id = broken
    if messages[i]["role"] == "tool":
        path = f"messages[{i}].tool_call_id"
        raise invalid(f"'{path}' is {call_id!r}, which answers no tool call of the assistant "
                      "message its tool messages follow", path)
    path = f"messages[{i}].tool_calls"
    raise invalid(f"'{path}' has a call {call_id!r} that no tool message answers: an assistant "
                  "message with tool_calls must be followed by a tool message for each call",
                  path)


def _check_assistant(msg: dict[str, Any], path: str, media: bool) -> None:
    """An assistant message: its content (text and refusal parts), which it may leave out when
    it carries tool calls or a `refusal` (what the SDK's message of a refused structured
    answer holds, sent back in the history), and its tool calls."""
    refusal = msg.get("refusal")
    if refusal is not None and not isinstance(refusal, str):
        raise invalid(f"'{path}.refusal' must be a string", f"{path}.refusal")
    if msg.get("tool_calls"):
        _check_tool_calls(msg["tool_calls"], f"{path}.tool_calls")
    content = msg.get("content")
    if content is None and (msg.get("tool_calls") or refusal is not None):
        return
    _check_content(content, f"{path}.content", "assistant" if media else None, refusals=True)


def _check_content(content: Any, path: str, role: str | None = None,
                   refusals: bool = False) -> None:
    """A string or an array of parts: text parts (and `refusals`: an assistant message's
    refusal parts), and in a user message for an upstream (`role` is the message's for an
    upstream, None for the embedded engine) the image_url, input_audio and file parts OpenAI
    takes there."""
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:  # OpenAI refuses an empty array too
        raise invalid(f"'{path}' must be a string or a non-empty array of content parts", path)
    for j, part in enumerate(content):
        part_path = f"{path}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        field = "refusal" if refusals and kind == "refusal" else "text"
        if kind != field:
            check_media_part(part, kind, part_path, role)
        elif not isinstance(part.get(field), str):
            raise invalid(f"'{part_path}.{field}' must be a string", f"{part_path}.{field}")


def _check_tool_calls(calls: Any, path: str) -> None:
    if not isinstance(calls, list):
        raise invalid(f"'{path}' must be an array", path)
    for j, call in enumerate(calls):
        call_path = f"{path}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"'{call_path}.function.name' must be a string", f"{call_path}.function")
        if not isinstance(fn.get("arguments", ""), str):
            raise invalid(
                f"'{call_path}.function.arguments' must be a JSON string",
                f"{call_path}.function.arguments",
            )
