"""lint_request: every check on one request, and what its prefix is worth."""

from __future__ import annotations

import re
from typing import Any

from prompt_lint.checks import (
    Moved,
    cache_control_findings,
    finding,
    history_findings,
    minimum_findings,
    tool_findings,
)
from prompt_lint.detectors import Span, detect
from prompt_lint.evidence import FIX_CONFIDENCE, LIKELY, Dynamic, decide
from prompt_lint.family import _SESSIONS_PER_FAMILY, Family
from prompt_lint.layout import TokenLayout, token_layout
from prompt_lint.opening import (
    Opening,
    OpeningCheck,
    check_opening,
    opening_of,
    record_opening,
)
from prompt_lint.providers import (
    Provider,
    Segment,
    check_request,
    compact_json,
    detect_provider,
    scan_targets,
    segments,
)
from prompt_lint.rules import DYNAMIC_KINDS, RULES
from prompt_lint.segment import without_breakpoints
from prompt_lint.session import SessionTracker, fingerprint
from prompt_lint.templates import FamilyMatch, TemplateLearner
from prompt_lint.tokens import DEFAULT_ENCODING, TokenCounter, shared_counter
from prompt_lint.toolset import tool_set
from prompt_lint.types import Finding, LintReport

_RULE_FOR_KIND = {"timestamp": "PL001", "identifier": "PL002", "nonce": "PL003",
                  "learned": "PL008", "session": "PL013"}
#: Rules whose finding ends the reusable prefix at its token offset.
BREAKING_RULES = frozenset({"PL001", "PL002", "PL003", "PL004", "PL006", "PL008", "PL009",
                            "PL013", "PL014"})
#: Finding kinds whose values a session's next request sends again (they end the prefix
#: its sessions share, not the session's own).
SESSION_KINDS = frozenset({"session", "opening"})
#: Tokens the rewriter leaves in place of one moved value (its marker).
MARKER_TOKENS = 6
#: How the rewriter's marker for a moved value begins (`[context:<kind>_<n>]`).
MARKER_OPEN = "[context:"
_MARKER = re.compile(re.escape(MARKER_OPEN) + r"[a-z]+_\d+\]")


def lint_request(body: dict[str, Any], provider: Provider | None = None,
                 learner: TemplateLearner | None = None,
                 session: SessionTracker | str | None = None,
                 encoding: str | None = None, layout: TokenLayout | None = None,
                 validated: bool = False, session_continues: bool | None = None) -> LintReport:
    """Lint one OpenAI or Anthropic request body; see the package docstring. `layout`: the
    body's token layout when the caller has tokenized it already (`layout_of`), in the
    encoding `encoding` names. `validated`: the caller has checked the body already, at least
    as strictly as `providers.validate` (the gateway's parsers do), so it is not checked again.
    `session_continues`: whether this request's session sends another one later, where the
    caller knows (`prefixgate lint` reads the whole log first; None: unknown). True: that
    request reuses the session-scoped values, so they end neither cacheable prefix. False:
    the family's next request is another session's, which shares no turn of this one, so
    neither prefix reaches past its first non-system message."""
    prov = provider or detect_provider(body)
    if not validated:
        toolset = check_request(body, prov)
    elif layout is not None and layout.toolset is not None:
        toolset = layout.toolset  # looked up when the layout was made
    else:
        toolset = tool_set(body.get("tools") or [])
    counter = shared_counter(encoding or DEFAULT_ENCODING)
    if layout is None:
        layout = token_layout(body, prov, counter, toolset)
    targets = scan_targets(body, layout.segments, toolset)
    spans = {t.path: detect(t.text, t.path) for t in targets}
    match = FamilyMatch(None, [])
    tracker = session if isinstance(session, SessionTracker) else (
        learner.sessions if learner is not None else None)
    # the first turn keys both the learner's evidence and the session (an explicit session
    # string keys both instead)
    keyed = not isinstance(session, str) and (learner is not None or tracker is not None)
    turn = first_turn(body) if keyed else None
    if learner is not None:
        match = learner.observe(targets, spans, list(toolset.labels),
                                conversation(body, session, turn))
    findings = _dynamic_findings(targets, spans, match, layout, counter)
    tool_found, resolved = tool_findings(body, prov, layout, match.family, toolset,
                                         _moved_spans(findings))
    findings += tool_found
    opened = _opening(body, learner, match.family, layout, counter)
    findings += opened.findings
    if opened.findings:
        resolved.add("PL014")  # fix moves the line after the shared text
    if tracker is not None:
        key = session_key(body, match.family.id if match.family else None, session, turn)
        findings += history_findings(body, layout, tracker, key)
    shared = _first_break(findings, layout.total)  # what the family's sessions share
    continues = session_continues is True
    cacheable = _first_break(findings, layout.total, continues)
    after = _after_fix(body, prov, findings, resolved, layout, counter, continues)
    if session_continues is False:
        now, later = _across_sessions(body, layout, opened, findings)
        cacheable, after = min(cacheable, now), min(after, later)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    findings += minimum_findings(prov, model, layout.total, shared,
                                 _after_fix(body, prov, findings, resolved, layout, counter))
    if prov == "anthropic":
        kinds = _first_break_kinds(findings, shared)
        scoped = bool(kinds) and kinds <= SESSION_KINDS
        findings += cache_control_findings(body, model, layout, shared, scoped)
    return LintReport(findings, layout.total, cacheable, after,
                      match.family.id if match.family else None, prov, opened.message)


def _opening(body: dict[str, Any], learner: TemplateLearner | None, family: Family | None,
             layout: TokenLayout, counter: TokenCounter) -> OpeningCheck:
    """PL014 (prompt_lint.opening); a learner that still learns remembers the opening after
    judging it, so a session is compared with the sessions seen before it."""
    if learner is None or family is None:
        return OpeningCheck([])
    opening = opening_of(body)
    memos = len(family.opening_memo)
    opened = check_opening(opening, family, learner.frozen, layout, counter)
    if not learner.frozen:
        remember_opening(learner, family, opening)
    if len(family.opening_memo) != memos:  # a comparison was kept: weigh the family again
        learner.families.reweigh(family.id, family.held_bytes)
    return opened


def remember_opening(learner: TemplateLearner, family: Family, opening: Opening | None) -> None:
    """Keep a request's opening user message in its family (and weigh the family again)."""
    if opening is not None and opening.key not in family.openings:
        record_opening(family, opening)
        learner.families.reweigh(family.id, family.held_bytes)


def _across_sessions(body: dict[str, Any], layout: TokenLayout, opened: OpeningCheck,
                     findings: list[Finding]) -> tuple[int, int]:
    """How far another session's request shares this one, as sent and after the fix: up to
    its first non-system message, or into it as far as the sessions' openings share text
    (after the fix: with the PL014 lines moved; a context block the fix gives that message goes
    at its end, below the shared text)."""
    end = _conversation_start(body, layout)
    now = opened.start + opened.shared_now if opened.shared_now else end
    after = opened.start + opened.shared_after if opened.shared_after else now
    return now, after


def _conversation_start(body: dict[str, Any], layout: TokenLayout) -> int:
    """Token offset of the first non-system message (the prompt's end when there is none)."""
    first = next((i for i, m in enumerate(body["messages"])
                  if m.get("role") not in {"system", "developer"}), None)
    return layout.total if first is None else layout.message_start(first)


def learn_request(body: dict[str, Any], learner: TemplateLearner,
                  provider: Provider | None = None, session: str | None = None) -> str | None:
    """Feed one request to the learner without linting it (first pass over a
    log); returns its family id. `session` as in lint_request (a string)."""
    prov = provider or detect_provider(body)
    toolset = check_request(body, prov)
    segs = segments(body, prov, toolset)
    targets = scan_targets(body, segs, toolset)
    spans = {t.path: detect(t.text, t.path) for t in targets}
    match = learner.observe(targets, spans, list(toolset.labels), conversation(body, session))
    if match.family is not None and not learner.frozen:
        remember_opening(learner, match.family, opening_of(body))
    return match.family.id if match.family else None


def conversation(body: dict[str, Any], session: SessionTracker | str | None,
                 turn: str | None = None) -> str:
    """The learner's session evidence key: the explicit session string, else the
    first non-system message (the learner scopes it by prompt family); `turn`: that
    message's `first_turn` when the caller has it."""
    if isinstance(session, str):
        return "s:" + session
    return "a:" + (first_turn(body) if turn is None else turn)


def session_key(body: dict[str, Any], family: str | None,
                session: SessionTracker | str | None, turn: str | None = None) -> str:
    """The explicit session string, else family + first non-system message (`turn` as in
    `conversation`)."""
    if isinstance(session, str):
        return "s:" + session
    return "a:" + fingerprint(family or "", first_turn(body) if turn is None else turn)


def first_turn(body: dict[str, Any]) -> str:
    """A fingerprint of the first non-system message's compact JSON (of "{}" when there is
    none), its blocks' Anthropic breakpoints left out: what the turns of one conversation
    share (an agent that moves its breakpoint to the newest block has one on its first
    message in the first turn only, which made that turn a conversation of its own)."""
    first: Any = next((m for m in body["messages"] if m.get("role") not in {"system", "developer"}),
                      {})
    content = first.get("content")
    if isinstance(content, list) and any(isinstance(b, dict) and "cache_control" in b
                                         for b in content):
        first = {**first, "content": [without_breakpoints(b) for b in content]}
    return fingerprint(compact_json(first))


def _token_offsets(target: Segment, starts: list[int], layout: TokenLayout,
                   counter: TokenCounter) -> list[int | None]:
    i = layout.paths.get(target.path)
    if i is None:  # a tool description: report the tool's start
        return [layout.start_of(target.path.split(".", 1)[0])] * len(starts)
    return [layout.starts[i] + n
            for n in counter.count_prefixes_at(target.text, target.path, starts)]


def _dynamic_findings(targets: list[Segment], spans: dict[str, list[Span]],
                      match: FamilyMatch, layout: TokenLayout,
                      counter: TokenCounter) -> list[Finding]:
    """Pattern and learned values, judged by the family's evidence (prompt_lint.evidence).
    A span holding a marker the rewriter wrote is stable text, never a value: where a family's
    requests are fixed and others are not yet (`--online`, whose early sessions have no
    evidence and keep their values), the marker was seen to vary and was moved again, nested
    in a second context block under a name the first one already used."""
    out = []
    for target in targets:
        found = decide(target.path, target.text, spans[target.path], match)
        if not found:
            continue
        offsets = _token_offsets(target, [d.start for d in found], layout, counter)
        for d, offset in zip(found, offsets, strict=True):
            if _overlaps_marker(target.text, d.start, d.end):
                continue  # the rewriter's own marker (see the docstring)
            rule = _RULE_FOR_KIND[d.kind]
            low = d.confidence < FIX_CONFIDENCE and RULES[rule].severity == "error"
            out.append(finding(rule, target.path, _message(d, match.family), start=d.start,
                               end=d.end,
                               value=target.text[d.start:d.end], token_offset=offset,
                               confidence=round(d.confidence, 2),
                               severity="warning" if low else None))
    return out


def _overlaps_marker(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] overlaps a marker the rewriter wrote (a learned span may hold
    part of one: the brackets are tokens of their own)."""
    if MARKER_OPEN[1:] not in text:
        return False
    return any(m.start() < end and start < m.end() for m in _MARKER.finditer(text))


def _message(d: Dynamic, family: Family | None) -> str:
    if not d.evidence or family is None:
        return f"{d.label} in the cached prefix (pattern only, no evidence from the family)"
    if d.kind == "session":
        what = "constant within a session but different across sessions of this prompt family"
    elif d.kind == "learned":
        what = "varies across requests of this prompt family"
    else:
        what = f"{d.label} in the cached prefix; varies across requests of this prompt family"
    return f"{what} ({_evidence(family)})"


def _evidence(family: Family) -> str:
    """How much of the log the family's evidence comes from: its requests and sessions (the
    sessions it remembers: at most `_SESSIONS_PER_FAMILY`)."""
    sessions = len(family.session_lines)
    many = "at least " if sessions >= _SESSIONS_PER_FAMILY else ""
    return (f"evidence: {family.requests} request{'s' * (family.requests != 1)} in "
            f"{many}{sessions} session{'s' * (sessions != 1)}")


def _moved_spans(findings: list[Finding]) -> Moved:
    """The spans rewrite_request moves out, by path, with their finding kinds."""
    out: Moved = {}
    for f in findings:
        if is_moved(f) and f.start is not None and f.end is not None:
            out.setdefault(f.path, []).append((f.start, f.end, f.kind))
    return out


def is_moved(f: Finding) -> bool:
    """Whether rewrite_request moves this finding's value into the context block."""
    return f.kind in DYNAMIC_KINDS and f.start is not None and f.confidence >= FIX_CONFIDENCE


def _first_break(findings: list[Finding], total: int, in_session: bool = False) -> int:
    """The token offset of the first finding that ends the reusable prefix (`total` when
    none does); `in_session`: for the session's next request, where a session-scoped value
    is the same."""
    offsets = [f.token_offset for f in findings
               if f.rule in BREAKING_RULES and f.token_offset is not None
               and f.confidence >= LIKELY and not (in_session and f.kind in SESSION_KINDS)]
    return min(offsets, default=total)


def _first_break_kinds(findings: list[Finding], offset: int) -> set[str]:
    """The kinds of the findings that break the prefix at `offset` (`_first_break`'s)."""
    return {f.kind for f in findings if f.rule in BREAKING_RULES and f.token_offset == offset
            and f.confidence >= LIKELY}


def context_target(body: dict[str, Any], provider: Provider) -> int | None:
    """Index of the message that receives the context block (the last user turn)."""
    messages = body["messages"]
    turn_roles = {"user", "tool"} if provider == "openai" else {"user"}
    if messages and messages[-1].get("role") in turn_roles:
        return len(messages) - 1
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    return users[-1] if users else None


def _after_fix(body: dict[str, Any], provider: Provider, findings: list[Finding],
               resolved: set[str], layout: TokenLayout, counter: TokenCounter,
               in_session: bool = False) -> int:
    """Estimate of the cacheable prefix once rewrite_request has run (`in_session`: for the
    session's next request, which resends this one's last turn, context block and all)."""
    moved = [f for f in findings if is_moved(f)]
    breaks = [f.token_offset for f in findings if f.rule in BREAKING_RULES
              and not is_moved(f) and f.rule not in resolved
              and f.token_offset is not None and f.confidence >= LIKELY]
    limit = min(breaks, default=layout.total)
    if not moved:
        return limit
    if in_session:
        return limit  # the moved values sit in a turn the next request resends as it is
    target = context_target(body, provider)
    at = layout.total if target is None else layout.message_start(target)
    saved = sum(counter.count(f.value) - MARKER_TOKENS for f in moved
                if f.token_offset is not None and f.token_offset < at)
    return max(0, min(limit, at - max(saved, 0)))
