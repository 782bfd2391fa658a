"""How Anthropic reads a Messages body's sequence of turns: consecutive turns of one role are
one turn, and a final assistant turn is the start of the answer (a prefill)."""

from __future__ import annotations

from typing import Any

from gateway.errors import invalid


def merge_turns(last: dict[str, Any], new: dict[str, Any]) -> bool:
    """Join `new` into `last` when both are user or both assistant messages, as Anthropic
    combines consecutive turns of one role into a single turn (texts one a line, calls in
    order); False when they stay apart."""
    role = new["role"]
    if role not in ("user", "assistant") or last["role"] != role:
        return False
    a, b = last.get("content") or "", new.get("content") or ""
    if isinstance(a, str) and isinstance(b, str):
        last["content"] = "\n".join(t for t in (a, b) if t)
    else:
        last["content"] = _as_parts(a) + _as_parts(b)
    calls = [*last.get("tool_calls", ()), *new.get("tool_calls", ())]
    if calls:
        last["tool_calls"] = calls
    return True


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def check_prefill_end(content: Any, path: str) -> None:
    """A final assistant message is the start of the answer; as Anthropic, its text may not
    end with whitespace (a 400)."""
    last = content[-1] if isinstance(content, list) and content else content
    text = last.get("text") if isinstance(last, dict) and last.get("type") == "text" else last
    if isinstance(text, str) and text and text != text.rstrip():
        raise invalid(f"'{path}.content' cannot end with trailing whitespace (a final "
                      "assistant message is the start of the answer)", f"{path}.content")


def is_prefilled(messages: list[dict[str, Any]], given: list[Any]) -> bool:
    """Whether the body ends with an assistant message that has text (the answer's start)."""
    last = given[-1] if given else None
    return isinstance(last, dict) and last.get("role") == "assistant" and \
        bool(messages[-1].get("content"))
