"""What prompt_lint derives from a tool list, computed once per distinct list.

Requests of one agent repeat their tool list verbatim. `tool_set(tools)`
keys the list by its marshal bytes (see `prompt_lint.memo`) and returns the
tools' layout segments (compact JSON, breakpoints left out: `without_breakpoints`), names,
description scan targets and schema key-order flags from a bounded LRU (1024 lists,
`BUDGETS.tool_sets` bytes), so an unchanged tool list is serialised once, not once per request.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from prompt_lint.budgets import BUDGETS
from prompt_lint.memo import LRU, encode_compact, memo_by_value
from prompt_lint.segment import Segment, tool_description_path, tool_name, without_breakpoints


class ToolSet(NamedTuple):
    """Per-tool facts of one tool list, in list order."""

    segments: tuple[Segment, ...]
    names: tuple[str | None, ...]
    labels: tuple[str, ...]  # names, "" for a tool without one
    descriptions: tuple[Segment, ...]
    schema_sorted: tuple[bool, ...]

    def first_unnamed(self) -> int | None:
        """Index of the first tool without a name, or None."""
        return next((i for i, n in enumerate(self.names) if n is None), None)


TOOLSET_MEMO: LRU[bytes, ToolSet] = LRU(1024, max_weight=BUDGETS.tool_sets)


def keys_sorted(value: Any) -> bool:
    """Whether every JSON object in `value` has its keys in sorted order."""
    if isinstance(value, dict):
        keys = list(value)
        return keys == sorted(keys) and all(keys_sorted(v) for v in value.values())
    if isinstance(value, list):
        return all(keys_sorted(v) for v in value)
    return True


def tool_schema(tool: Any) -> Any:
    """The tool's parameter schema (OpenAI `function.parameters`, Anthropic `input_schema`)."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if isinstance(function, dict):
        return function.get("parameters")
    return tool.get("input_schema") if isinstance(tool, dict) else None


def _compute(tools: list[Any]) -> ToolSet:
    names = tuple(tool_name(t, "openai") for t in tools)
    segments = tuple(Segment(f"tools[{i}]", encode_compact(without_breakpoints(t)), False, -1)
                     for i, t in enumerate(tools))
    descriptions = []
    for i, tool in enumerate(tools):
        found = tool_description_path(tool, i) if isinstance(tool, dict) else None
        if found is not None:
            descriptions.append(Segment(found[0], found[1], True, -1))
    return ToolSet(segments, names, tuple(n or "" for n in names), tuple(descriptions),
                   tuple(keys_sorted(tool_schema(t)) for t in tools))


def tool_set(tools: list[Any]) -> ToolSet:
    """The ToolSet of `tools` (a list), memoised by value."""
    return memo_by_value(TOOLSET_MEMO, tools, _compute)
