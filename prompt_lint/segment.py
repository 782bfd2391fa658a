"""The token layout's unit (`Segment`) and the tool-definition accessors it is built from.

The lowest module of prompt_lint's request model: `providers` (the layout of a whole request)
and `toolset` (the per-tool-list memo) both build on it, and it imports neither.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Segment(NamedTuple):
    """One piece of the token layout.

    `path`: where the text lives in the body; `text`: what is tokenized;
    `scan`: whether it is template material (system prompt, tool text) that
    pattern detectors and template learning look at; `message`: the message
    index, or -1 for tools and the Anthropic system prompt.
    """

    path: str
    text: str
    scan: bool
    message: int


def tool_name(tool: Any, provider: str) -> str | None:
    """The tool's name, or None when the definition has none."""
    if not isinstance(tool, dict):
        return None
    name = tool.get("name")
    function = tool.get("function")
    if name is None and isinstance(function, dict):
        name = function.get("name")
    return name if isinstance(name, str) else None


def tool_description_path(tool: dict[str, Any], i: int) -> tuple[str, str] | None:
    """(path, text) of the tool's description string, if it has one."""
    function = tool.get("function")
    if isinstance(function, dict) and isinstance(function.get("description"), str):
        return f"tools[{i}].function.description", function["description"]
    if isinstance(tool.get("description"), str):
        return f"tools[{i}].description", tool["description"]
    return None
