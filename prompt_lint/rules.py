"""The rule registry: every check prompt_lint makes, with a stable id.

Ids never change meaning once published; new rules get new ids. A rule's
`kind` is the machine-readable category a finding carries (`timestamp`,
`identifier`, `tool_order`, ...); its `fix` says what `prefixgate fix` (or
the author) should do about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning", "info"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "error": 2}

#: Finding kinds whose spans change between requests and are moved by the rewriter.
DYNAMIC_KINDS: frozenset[str] = frozenset({"timestamp", "identifier", "nonce", "learned",
                                           "session"})


@dataclass(frozen=True, slots=True)
class Rule:
    """One lint rule: stable id, short name, default severity, kind, explanation, fix."""

    id: str
    name: str
    severity: Severity
    kind: str
    explanation: str
    fix: str

    def __post_init__(self) -> None:
        if not (self.id.startswith("PL") and self.id[2:].isdigit()):
            raise ValueError(f"rule id must look like PL001, got {self.id!r}")
        if self.severity not in SEVERITY_RANK:
            raise ValueError(f"unknown severity {self.severity!r} for {self.id}")


def _rules(*rules: Rule) -> dict[str, Rule]:
    return {rule.id: rule for rule in rules}


RULES: dict[str, Rule] = _rules(
    Rule("PL001", "timestamp-in-prefix", "error", "timestamp",
         "A date, time or Unix epoch sits in the cached prefix; it changes every request "
         "(or every day) and ends the reusable prefix there.",
         "Move the value into the context block at the start of the last user turn."),
    Rule("PL002", "identifier-in-prefix", "error", "identifier",
         "A per-user or per-request identifier (UUID, session/user/request/trace id, email, "
         "API key, JWT, hex digest) sits in the cached prefix, so no two users share it.",
         "Move the value into the context block at the start of the last user turn."),
    Rule("PL003", "nonce-in-prefix", "error", "nonce",
         "A per-request nonce, counter or random-looking token sits in the cached prefix.",
         "Drop it, or move it into the context block at the start of the last user turn."),
    Rule("PL004", "tool-order-changed", "error", "tool_order",
         "The tool list of this prompt family arrives in a different order than before; "
         "everything after the first moved tool is recomputed.",
         "Sort tools by name (prefixgate fix does)."),
    Rule("PL005", "tools-not-sorted", "info", "tool_order",
         "Tools are not in canonical (name) order; any reordering upstream will break the cache.",
         "Sort tools by name (prefixgate fix does)."),
    Rule("PL006", "tool-json-changed", "error", "tool_json",
         "A tool definition's JSON (key order, spacing or text) differs from the previous "
         "request of this prompt family.",
         "Serialise tool schemas canonically and keep their text fixed."),
    Rule("PL007", "non-canonical-json", "info", "json",
         "A tool schema's keys are not in canonical (sorted) order; serialisers that reorder "
         "keys produce different bytes for the same tool.",
         "Canonicalise the JSON (sorted keys); prefixgate fix does for tool schemas."),
    Rule("PL008", "learned-dynamic-span", "warning", "learned",
         "Template learning saw this span vary across requests of one prompt family although "
         "no pattern names it.",
         "Move the value into the context block at the start of the last user turn."),
    Rule("PL009", "history-not-append-only", "error", "history",
         "An earlier turn of this session was edited, removed or reordered; the cache can only "
         "reuse the history up to the first change.",
         "Append new turns; never rewrite earlier ones (summarise into a new turn instead)."),
    Rule("PL010", "prefix-below-minimum", "warning", "short_prefix",
         "The stable prefix is shorter than the provider's minimum cacheable length, so the "
         "provider caches nothing although the prompt is long enough.",
         "Move stable material (instructions, tools, background) before the dynamic parts."),
    Rule("PL011", "cache-control-missing", "warning", "cache_control",
         "Anthropic request long enough to cache, but no cache_control breakpoint is set, so "
         "nothing is cached.",
         "Add cache_control {'type': 'ephemeral'} to the last stable block (end of system)."),
    Rule("PL012", "cache-control-misplaced", "warning", "cache_control",
         "An Anthropic cache_control breakpoint sits after a dynamic span, before the "
         "provider minimum, or beyond the four allowed; that cache entry is never reused.",
         "Put breakpoints on the last stable block before any dynamic value (at most four)."),
    Rule("PL013", "session-scoped-value", "error", "session",
         "A value that stays the same inside a session but differs across the sessions of "
         "this prompt family (a user handle, account, plan or session id); every session "
         "starts a cache of its own at that point.",
         "Move the value into the context block at the start of the last user turn."),
    Rule("PL014", "value-before-shared-text", "error", "opening",
         "A timestamp, id or other value that differs across sessions sits on a line of the "
         "first user message before text that the sessions of this prompt family all send "
         "(a guide, a document); the session reuses it, but every new session caches that "
         "text again.",
         "Put the line after the shared text (prefixgate fix moves it to the end of the "
         "message)."),
)
