"""Structural and cross-request checks: tools, history, provider minimums, cache_control."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from prompt_lint.layout import TokenLayout
from prompt_lint.providers import Provider
from prompt_lint.rules import RULES, Severity
from prompt_lint.segment import tool_description_path, without_breakpoints
from prompt_lint.session import SessionTracker
from prompt_lint.templates import Family
from prompt_lint.toolset import ToolSet, tool_set
from prompt_lint.types import Finding

OPENAI_MIN_TOKENS = 1024
#: Anthropic minimum cacheable prompt length by model-name substring; first match wins.
ANTHROPIC_MIN_TOKENS: tuple[tuple[str, int], ...] = (("haiku", 2048), ("", 1024))
MAX_ANTHROPIC_BREAKPOINTS = 4


def finding(rule_id: str, path: str, message: str, *, start: int | None = None,
            end: int | None = None, value: str = "", token_offset: int | None = None,
            confidence: float = 1.0, severity: Severity | None = None) -> Finding:
    """A Finding for registry rule `rule_id` (`severity` overrides the rule's)."""
    rule = RULES[rule_id]
    return Finding(rule.id, rule.name, severity or rule.severity, rule.kind, path, start, end,
                   message, value, token_offset, confidence)


def min_cacheable_tokens(provider: Provider, model: str | None) -> int:
    """The provider's minimum cacheable prompt length for `model`."""
    if provider == "openai":
        return OPENAI_MIN_TOKENS
    name = (model or "").lower()
    return next(n for key, n in ANTHROPIC_MIN_TOKENS if key in name)


def canonical_json(value: Any) -> str:
    """Sorted keys, compact separators: the one spelling of a JSON value."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


#: Spans of a string the rewriter moves out (path -> [(start, end, finding kind)]):
#: `tool_findings` masks them in a tool's description to tell a tool whose JSON changed only
#: by such a value.
Moved = dict[str, list[tuple[int, int, str]]]


def tool_findings(body: dict[str, Any], provider: Provider, layout: TokenLayout,
                  family: Family | None, toolset: ToolSet | None = None,
                  moved: Moved | None = None) -> tuple[list[Finding], set[str]]:
    """PL004-PL007; returns findings and the rules a rewrite resolves.

    The family's tool state (last order, JSON per tool name) is updated on
    every call, frozen learner or not: it is "the previous request", not a
    learned template. `moved`: the spans the rewriter moves into the context block; a tool
    whose content changed only there (a session id in its description) is the same tool
    once fixed, so its PL006 stays resolved."""
    tools = body.get("tools") or []
    toolset = toolset or tool_set(tools)
    names = list(toolset.labels)
    out: list[Finding] = []
    if names != sorted(names):
        out.append(finding("PL005", "tools", "tools are not sorted by name"))
    unsorted = [n for n, ok in zip(names, toolset.schema_sorted, strict=True) if not ok]
    if unsorted:
        out.append(finding("PL007", "tools", f"{len(unsorted)} tool schema(s) with unsorted "
                           f"JSON keys: {', '.join(unsorted[:5])}"))
    resolved = {"PL004", "PL005", "PL006", "PL007"}  # PL006 left out below where it is not
    if family is None:
        return out, resolved
    if family.last_tools is toolset and len(set(names)) == len(names):
        # the very tool list this family saw last (memoised ToolSet): nothing changed
        family.tool_names = names
        return out, resolved
    changes = _tool_changes(tools, names, layout, family, resolved, moved or {})
    block = hash(tuple(seg.text for seg in toolset.segments))
    if block in family.tool_blocks:  # sent before: its own cache entry is there
        changes = [replace(f, token_offset=None, message=f"{f.message}; a tool list this "
                           "family sent before, cached apart") for f in changes]
    out += changes
    family.tool_names = names
    _remember_block(family, block)
    family.last_tools = toolset
    for i, name in enumerate(names):
        compact = layout.segments[i].text  # tools come first in the layout
        old = family.tool_json.get(name)
        if old is None or old[0] != hash(compact):
            family.tool_json[name] = _tool_prints(tools[i], compact, i, moved or {})
    return out, resolved


#: Distinct tool lists (as sent: order and JSON) a family remembers, the most recent: a list
#: it sent before has a cache entry of its own, which a request returning to it reuses (an
#: agent whose workers order a set, or serialise a schema, each their own way), so the PL004 /
#: PL006 of such a request end no cacheable prefix.
TOOL_BLOCKS = 4


def _remember_block(family: Family, block: int) -> None:
    if block in family.tool_blocks:
        family.tool_blocks.remove(block)
    family.tool_blocks.append(block)
    del family.tool_blocks[:-TOOL_BLOCKS]


def _session_only(tool: Any, i: int, moved: Moved) -> bool:
    """Whether every value moved out of the tool's description is session-scoped."""
    found = tool_description_path(tool, i) if isinstance(tool, dict) else None
    spans = moved.get(found[0], []) if found is not None else []
    return bool(spans) and all(kind == "session" for _, _, kind in spans)


def _tool_prints(tool: Any, compact: str, i: int, moved: Moved) -> tuple[int, int, int]:
    """(hash of the JSON as sent, hash of its canonical form, hash of the canonical form with
    the moved spans of its description masked: the tool as the rewriter leaves it);
    in-process state only."""
    canonical = canonical_json(without_breakpoints(tool))
    found = tool_description_path(tool, i) if isinstance(tool, dict) else None
    spans = moved.get(found[0]) if found is not None else None
    if found is None or not spans:
        return hash(compact), hash(canonical), hash(canonical)
    text, pos, parts = found[1], 0, []
    for start, end, _ in sorted(spans):
        parts += [text[pos:start], "\x00"]
        pos = max(pos, end)
    masked = dict(without_breakpoints(tool))
    description = "".join(parts) + text[pos:]
    if isinstance(masked.get("function"), dict):
        masked["function"] = {**masked["function"], "description": description}
    else:
        masked["description"] = description
    return hash(compact), hash(canonical), hash(canonical_json(masked))


def _tool_changes(tools: list[Any], names: list[str], layout: TokenLayout, family: Family,
                  resolved: set[str], moved: Moved) -> list[Finding]:
    out: list[Finding] = []
    before = family.tool_names
    if before is not None and before != names and sorted(before) == sorted(names):
        first = next(i for i, (a, b) in enumerate(zip(before, names, strict=True)) if a != b)
        out.append(finding("PL004", "tools", f"tool order changed at position {first} "
                           f"({before[first]!r} before, {names[first]!r} now)",
                           token_offset=layout.start_of(f"tools[{first}]")))
    for i, (name, tool) in enumerate(zip(names, tools, strict=True)):
        old = family.tool_json.get(name)
        compact = layout.segments[i].text
        if old is None or old[0] == hash(compact):
            continue
        new = _tool_prints(tool, compact, i, moved)
        key_order_only = old[1] == new[1]
        if old[2] != new[2]:  # not the same tool once fixed either
            resolved.discard("PL006")
        what = "key order" if key_order_only else "content" if old[2] != new[2] else \
            "content: only the value moved out of its description"
        # a new session's own value (its PL013 ends the prefix there already): the
        # session's next request sends the same, so this change is no break of its own
        scoped = not key_order_only and old[2] == new[2] and _session_only(tool, i, moved)
        out.append(finding("PL006", f"tools[{i}]", f"tool {name!r} JSON changed ({what})",
                           token_offset=None if scoped else layout.start_of(f"tools[{i}]")))
    return out


def history_findings(body: dict[str, Any], layout: TokenLayout, tracker: SessionTracker,
                     key: str) -> list[Finding]:
    """PL009: compare this request's non-system history with the session's last one."""
    # a message's segments run from its header segment to the next message's header
    texts = [seg.text for seg in layout.segments]
    history, indexes = [], []
    messages = body["messages"]
    heads = [layout.paths[f"messages[{i}]"] for i in range(len(messages))] + [len(texts)]
    for i, message in enumerate(messages):
        if message.get("role") not in {"system", "developer"}:
            history.append(str(hash(tuple(texts[heads[i]:heads[i + 1]]))))
            indexes.append(i)
    changed = tracker.compare_and_record(key, history, indexes)
    if changed is None:
        return []
    return [finding("PL009", f"messages[{changed}]",
                    f"messages[{changed}] differs from the previous request of this session",
                    token_offset=layout.message_start(changed))]


def minimum_findings(provider: Provider, model: str | None, prompt_tokens: int,
                     cacheable: int, after_fix: int) -> list[Finding]:
    """PL010: long prompt, short stable prefix."""
    minimum = min_cacheable_tokens(provider, model)
    if prompt_tokens < minimum or cacheable >= minimum:
        return []
    hint = "the fix reaches it" if after_fix >= minimum else "the fix does not reach it either"
    return [finding("PL010", "", f"stable prefix is {cacheable} tokens, below the {provider} "
                    f"minimum of {minimum} for {model or 'this model'}; {hint}",
                    token_offset=cacheable)]


def _breakpoints(body: dict[str, Any], layout: TokenLayout) -> list[tuple[str, int]]:
    """(path, token end offset) of every cache_control breakpoint."""
    found: list[tuple[str, int]] = []

    def add(path: str, block: Any) -> None:
        if isinstance(block, dict) and block.get("cache_control"):
            i = layout.paths.get(path, layout.paths.get(path + ".text"))
            end = layout.total if i is None else layout.starts[i] + layout.sizes[i]
            found.append((path, end))

    for i, tool in enumerate(body.get("tools") or []):
        add(f"tools[{i}]", tool)
    system = body.get("system")
    if isinstance(system, list):
        for j, block in enumerate(system):
            add(f"system[{j}]", block)
    for i, message in enumerate(body["messages"]):
        content = message.get("content")
        if isinstance(content, list):
            for j, block in enumerate(content):
                add(f"messages[{i}].content[{j}]", block)
    return found


def cache_control_findings(body: dict[str, Any], model: str | None, layout: TokenLayout,
                           cacheable: int, session_scoped: bool = False) -> list[Finding]:
    """PL011/PL012 for Anthropic requests; `session_scoped`: the first dynamic value is one
    that stays the same within a session (its entries are reused there, not across)."""
    minimum = min_cacheable_tokens("anthropic", model)
    points = _breakpoints(body, layout)
    if not points and not body.get("cache_control"):
        if layout.total < minimum:
            return []
        return [finding("PL011", "system", f"{layout.total} tokens and no cache_control "
                        "breakpoint: nothing will be cached")]
    out: list[Finding] = []
    if len(points) > MAX_ANTHROPIC_BREAKPOINTS:
        out.append(finding("PL012", points[MAX_ANTHROPIC_BREAKPOINTS][0],
                           f"{len(points)} breakpoints; the API allows "
                           f"{MAX_ANTHROPIC_BREAKPOINTS}"))
    for path, end in points:
        if end < minimum and layout.total >= minimum:
            out.append(finding("PL012", path, f"breakpoint at token {end}, below the minimum "
                               f"of {minimum}: it caches nothing", token_offset=end))
    if points and min(end for _, end in points) > cacheable:
        path, end = min(points, key=lambda p: p[1])
        reuse = ("no entry is reused across sessions (within one, the value stays the same)"
                 if session_scoped else "no entry is reused")
        out.append(finding("PL012", path, f"every breakpoint (first at token {end}) lies after "
                           f"the first dynamic value at token {cacheable}: {reuse}",
                           token_offset=end))
    return out
