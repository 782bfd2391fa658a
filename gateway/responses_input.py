"""A Responses API `instructions` + `input` as chat completions messages.

`input` is a string (one user message) or a list of items: messages (`type: "message"` or a
bare `{role, content}`; roles user, assistant, system, developer; content a string or parts:
`input_text`, `input_image`, `input_file`; in an assistant message `output_text`, `refusal`
and `input_text`), `function_call` (an assistant message's tool call: consecutive calls, and a call
after an assistant message, join that message), `function_call_output` (a tool message) and
`reasoning` (dropped: the gateway's models get no reasoning history). Other item types (a
built-in tool's calls, `item_reference`) need state or tools the gateway does not have: a 400
naming the type.

`Converted.paths` maps each chat path to the Responses path it came from, so that an error the
chat parser raises names the field the client sent (`input[3].content[0]`, not
`messages[4].content[0]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import invalid

ROLES = ("user", "assistant", "system", "developer")
#: the Responses content part types of a message's content, by role
_TEXT_PARTS = {"input_text"}
_ASSISTANT_PARTS = {"output_text", "input_text", "refusal"}  # input_text: some clients' history
_MEDIA_PARTS = {"input_image", "input_file"}


@dataclass
class Converted:
    """The chat messages and, for error messages, where each chat path came from."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.paths[f"messages[{len(self.messages)}]"] = origin
        self.messages.append(message)


def to_messages(instructions: Any, items: Any) -> Converted:
    """The chat messages of `instructions` (a system message, first) and `input`."""
    out = Converted()
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("'instructions' must be a string", "instructions")
        if instructions:
            out.add({"role": "system", "content": instructions}, "instructions")
    if isinstance(items, str):
        if not items:
            raise invalid("'input' must be a non-empty string or array of items", "input")
        out.add({"role": "user", "content": items}, "input")
        return out
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a non-empty string or array of items", "input")
    for i, item in enumerate(items):
        _item(out, item, f"input[{i}]")
    return out


def _item(out: Converted, item: Any, path: str) -> None:
    if not isinstance(item, dict):
        raise invalid(f"'{path}' must be an object", path)
    kind = item.get("type", "message")
    if kind == "message":
        out.add(_message(item, path), path)
    elif kind == "function_call":
        _function_call(out, item, path)
    elif kind == "function_call_output":
        _function_call_output(out, item, path)
    elif kind == "reasoning":
        return
    elif kind == "item_reference":
        raise invalid(f"'{path}': item references are not supported: prefixgate keeps no "
                      "responses (stateless), send the item itself", f"{path}.type")
    else:
        raise invalid(f"'{path}.type' {kind!r} is not supported: prefixgate takes message, "
                      "function_call, function_call_output and reasoning items",
                      f"{path}.type")


def _message(item: dict[str, Any], path: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"'{path}.role' must be one of {', '.join(ROLES)}", f"{path}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise invalid(f"'{path}.content' must be a string or a non-empty array of content "
                      "parts", f"{path}.content")
    parts = [_part(p, role, f"{path}.content[{j}]") for j, p in enumerate(content)]
    if role == "assistant" and all(p["type"] == "refusal" for p in parts):
        return {"role": role, "content": None, "refusal": "".join(p["refusal"] for p in parts)}
    return {"role": role, "content": _joined(parts)}


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part as a plain string (what a chat client sends), else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        text: str = parts[0]["text"]
        return text
    return parts


def _part(part: Any, role: str, path: str) -> dict[str, Any]:
    """A Responses content part as a chat content part."""
    kind = part.get("type") if isinstance(part, dict) else None
    allowed = _ASSISTANT_PARTS if role == "assistant" else _TEXT_PARTS | _MEDIA_PARTS
    if kind not in allowed:
        raise invalid(f"'{path}.type' must be one of {', '.join(sorted(allowed))} in "
                      f"{role} messages", f"{path}.type")
    assert isinstance(part, dict)
    if kind == "refusal":
        return {"type": "refusal", "refusal": _string(part, "refusal", path)}
    if kind == "input_image":
        return _image(part, path)
    if kind == "input_file":
        return _file(part, path)
    return {"type": "text", "text": _string(part, "text", path)}


def _string(obj: dict[str, Any], name: str, path: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise invalid(f"'{path}.{name}' must be a string", f"{path}.{name}")
    return value


def _image(part: dict[str, Any], path: str) -> dict[str, Any]:
    """`input_image` {image_url, detail} as chat's image_url part (a file id needs OpenAI's
    file store: a 400)."""
    if part.get("file_id") is not None:
        raise invalid(f"'{path}.file_id' is not supported: send the image as 'image_url' (an "
                      "http(s) URL or a base64 data URL)", f"{path}.file_id")
    image: dict[str, Any] = {"url": part.get("image_url")}
    if part.get("detail") is not None:
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _file(part: dict[str, Any], path: str) -> dict[str, Any]:
    """`input_file` {file_data, filename} as chat's file part (a file id or URL: a 400)."""
    for name in ("file_id", "file_url"):
        if part.get(name) is not None:
            raise invalid(f"'{path}.{name}' is not supported: send the file inline as "
                          "'file_data'", f"{path}.{name}")
    inner = {k: part[k] for k in ("file_data", "filename") if part.get(k) is not None}
    return {"type": "file", "file": inner}


def _function_call(out: Converted, item: dict[str, Any], path: str) -> None:
    """A call of the model's earlier turn: joins the assistant message just before it (its
    text, or the turn's earlier calls), else starts one."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{path}.call_id' must be a non-empty string", f"{path}.call_id")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{path}.name' must be a non-empty string", f"{path}.name")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": _string(item, "arguments", path)}}
    last = out.messages[-1] if out.messages else None
    if last is None or last["role"] != "assistant" or last.get("refusal") is not None:
        out.add(last := {"role": "assistant", "content": None}, path)
    calls = last.setdefault("tool_calls", [])
    where = f"messages[{len(out.messages) - 1}].tool_calls"
    out.paths.setdefault(where, path)  # the turn's calls: where the first came from
    call_path = f"{where}[{len(calls)}]"
    out.paths[call_path] = path
    out.paths[f"{call_path}.function.name"] = f"{path}.name"
    out.paths[f"{call_path}.function.arguments"] = f"{path}.arguments"
    calls.append(call)


def _function_call_output(out: Converted, item: dict[str, Any], path: str) -> None:
    """A call's result: a tool message (text, or text parts)."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{path}.call_id' must be a non-empty string", f"{path}.call_id")
    output = item.get("output")
    if isinstance(output, list) and output:
        parts = []
        for j, part in enumerate(output):
            part_path = f"{path}.output[{j}]"
            if not isinstance(part, dict) or part.get("type") != "input_text":
                raise invalid(f"'{part_path}' must be an input_text part: a tool result "
                              "carries only text here", part_path)
            parts.append({"type": "text", "text": _string(part, "text", part_path)})
        content: Any = _joined(parts)
    elif isinstance(output, str):
        content = output
    else:
        raise invalid(f"'{path}.output' must be a string or an array of input_text parts",
                      f"{path}.output")
    i = len(out.messages)
    out.add({"role": "tool", "tool_call_id": call_id, "content": content}, path)
    out.paths[f"messages[{i}].tool_call_id"] = f"{path}.call_id"
    out.paths[f"messages[{i}].content"] = f"{path}.output"
