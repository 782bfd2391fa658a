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


def without_breakpoints(block: Any) -> Any:
    """A tool or content block as the model reads it: its Anthropic `cache_control` (and that
    of the blocks in a tool_result's content) taken out. A breakpoint only says where to write
    a cache entry; the cache matches prefixes by content, so an agent that moves its
    breakpoint to the newest block every turn changes nothing cached. A block without one is
    returned as it is."""
    if not isinstance(block, dict):
        return block
    content = block.get("content")
    nested = content if isinstance(content, list) and any(
        isinstance(b, dict) and "cache_control" in b for b in content) else None
    if "cache_control" not in block and nested is None:
        return block
    out = {k: v for k, v in block.items() if k != "cache_control"}
    if nested is not None:
        out["content"] = [without_breakpoints(b) for b in nested]
    return out


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
