"""Request formats: provider detection, validation, and the segment layout.

A request is flattened into `Segment`s in the order a provider caches it:
tool definitions first, then the system prompt, then the messages. Both
OpenAI (tools are rendered ahead of the conversation) and Anthropic (cache
prefix order tools -> system -> messages) read a request in this order, and
the token layout used for counting and for replay is the concatenation of the
segments' tokens.
"""

from __future__ import annotations

from typing import Any, Literal

from prompt_lint.media import layout_text
from prompt_lint.memo import compact_json_cached
from prompt_lint.segment import Segment, tool_description_path, tool_name, without_breakpoints
from prompt_lint.toolset import ToolSet, tool_set

Provider = Literal["openai", "anthropic"]
PROVIDERS: tuple[Provider, ...] = ("openai", "anthropic")
_SYSTEM_ROLES = frozenset({"system", "developer"})


class RequestError(ValueError):
    """The body is not a request prompt_lint understands."""


def detect_provider(body: dict[str, Any]) -> Provider:
    """Guess the request format: Anthropic Messages or OpenAI Chat Completions.

    Anthropic bodies have a top-level `system`, `max_tokens` with typed content
    blocks, or `input_schema` tools; OpenAI bodies have system/developer/tool
    roles or `function` tools. Ambiguous bodies are OpenAI.
    """
    if not isinstance(body, dict):
        raise RequestError(f"request must be a JSON object, got {type(body).__name__}")
    if "system" in body:
        return "anthropic"
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict):
        if "input_schema" in tools[0]:
            return "anthropic"
        if "function" in tools[0]:
            return "openai"
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") in {"system", "developer", "tool"}:
            return "openai"
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in {"tool_use", "tool_result"} for b in content
        ):
            return "anthropic"
    return "openai"


def validate(body: Any, provider: Provider) -> None:
    """Raise RequestError naming the first problem in `body`."""
    check_request(body, provider)


def check_request(body: Any, provider: Provider) -> ToolSet:
    """validate(), returning the body's ToolSet (see `prompt_lint.toolset`)."""
    if not isinstance(body, dict):
        raise RequestError(f"request must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        _validate_message(message, i, provider)
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    toolset = tool_set(tools)
    unnamed = toolset.first_unnamed()
    if unnamed is not None:
        raise RequestError(f"tools[{unnamed}] has no name")
    system = body.get("system")
    if provider == "anthropic" and system is not None and not isinstance(system, str | list):
        raise RequestError("'system' must be a string or a list of text blocks")
    return toolset


_ANTHROPIC_ROLES = frozenset({"user", "assistant"})
_OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _validate_message(message: Any, i: int, provider: Provider) -> None:
    if not isinstance(message, dict):
        raise RequestError(f"messages[{i}] must be an object")
    role = message.get("role")
    allowed = _ANTHROPIC_ROLES if provider == "anthropic" else _OPENAI_ROLES
    if role not in allowed:
        raise RequestError(f"messages[{i}].role {role!r} is not valid for {provider}")
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise RequestError(f"messages[{i}].content must be a string or a list")
    if content is None and provider == "anthropic":
        raise RequestError(f"messages[{i}].content is missing")


def compact_json(value: Any) -> str:
    """JSON as the layout tokenizes it: compact, key order as given (memoised by value,
    see `prompt_lint.memo`)."""
    return compact_json_cached(value)


def segments(body: dict[str, Any], provider: Provider,
             toolset: ToolSet | None = None) -> list[Segment]:
    """The request's token layout: tools, system prompt, then messages (`toolset`:
    the body's ToolSet when the caller has it already)."""
    if toolset is None:
        toolset = tool_set(body.get("tools") or [])
    out = list(toolset.segments)
    system = body.get("system")
    if provider == "anthropic" and system is not None:
        out += _content_segments("system", system, True, -1)
    add = out.append
    for i, message in enumerate(body["messages"]):
        role = message.get("role", "")
        head, body_path, calls_path = _message_paths(i)
        add(_segment(head, _role_header(role), False, i))
        content = message.get("content")
        if isinstance(content, str):
            add(_segment(body_path, content, role in _SYSTEM_ROLES, i))
        else:
            out += _content_segments(body_path, content, role in _SYSTEM_ROLES, i)
        if message.get("tool_calls"):
            add(_segment(calls_path, compact_json(message["tool_calls"]), False, i))
    return out


def _segment(path: str, text: str, scan: bool, message: int) -> Segment:
    """Segment(path, text, scan, message) without the keyword-argument layer of a named
    tuple's constructor (a 4k-token request has ~50 segments; half the cost of making them)."""
    return _new_tuple(Segment, (path, text, scan, message))


_new_tuple = tuple.__new__
_ROLE_HEADERS = {role: f"<|{role}|>\n"
                 for role in ("system", "developer", "user", "assistant", "tool", "function")}


def _role_header(role: Any) -> str:
    """The header segment's text of a message with `role` (a known role's is made once; a
    body that was not validated may carry any value there)."""
    header = _ROLE_HEADERS.get(role) if type(role) is str else None
    return header if header is not None else f"<|{role}|>\n"


_PATHS: list[tuple[str, str, str]] = []
_MAX_PATHS = 65536


def _message_paths(i: int) -> tuple[str, str, str]:
    """The paths of message i, its content and its tool calls, built once per index (at most
    65536 kept)."""
    if i < len(_PATHS):
        return _PATHS[i]
    paths = (f"messages[{i}]", f"messages[{i}].content", f"messages[{i}].tool_calls")
    if i == len(_PATHS) and i < _MAX_PATHS:
        _PATHS.append(paths)
    return paths


def _content_segments(path: str, content: Any, scan: bool, message: int) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return [Segment(path, content, scan, message)]
    out = []
    for j, block in enumerate(content):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            out.append(Segment(f"{path}[{j}].text", block["text"], scan, message))
        else:  # an image's or a file's inline bytes as their digest (prompt_lint.media)
            text = layout_text(without_breakpoints(block), compact_json)
            out.append(Segment(f"{path}[{j}]", text, False, message))
    return out


def scan_targets(body: dict[str, Any], layout: list[Segment],
                 toolset: ToolSet | None = None) -> list[Segment]:
    """Template strings to scan: tool descriptions, then system-prompt text.

    `layout` is `segments(body, provider)`; tool descriptions carry the
    index of their tool segment in `message` so token offsets can be found.
    """
    if toolset is None:
        toolset = tool_set(body.get("tools") or [])
    return list(toolset.descriptions) + [s for s in layout if s.scan]


__all__ = [
    "PROVIDERS",
    "Provider",
    "RequestError",
    "Segment",
    "ToolSet",
    "check_request",
    "compact_json",
    "detect_provider",
    "scan_targets",
    "segments",
    "tool_description_path",
    "tool_name",
    "validate",
]
