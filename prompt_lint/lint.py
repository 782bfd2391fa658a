"""lint_request: every check on one request, and what its prefix is worth."""

from __future__ import annotations

from typing import Any

from prompt_lint.checks import (
    cache_control_findings,
    finding,
    history_findings,
    minimum_findings,
    tool_findings,
)
from prompt_lint.detectors import Span, detect
from prompt_lint.layout import TokenLayout, token_layout
from prompt_lint.providers import (
    Provider,
    Segment,
    check_request,
    compact_json,
    detect_provider,
    scan_targets,
    segments,
)
from prompt_lint.rules import DYNAMIC_KINDS
from prompt_lint.session import SessionTracker, fingerprint
from prompt_lint.templates import FamilyMatch, TemplateLearner
from prompt_lint.tokens import DEFAULT_ENCODING, TokenCounter, shared_counter
from prompt_lint.types import Finding, LintReport

_RULE_FOR_KIND = {"timestamp": "PL001", "identifier": "PL002", "nonce": "PL003"}
#: Rules whose finding ends the reusable prefix at its token offset.
BREAKING_RULES = frozenset({"PL001", "PL002", "PL003", "PL004", "PL006", "PL008", "PL009"})
#: Tokens the rewriter leaves in place of one moved value (its marker).
MARKER_TOKENS = 6


def lint_request(body: dict[str, Any], provider: Provider | None = None,
                 learner: TemplateLearner | None = None,
                 session: SessionTracker | str | None = None,
                 encoding: str | None = None) -> LintReport:
    """Lint one OpenAI or Anthropic request body; see the package docstring."""
    prov = provider or detect_provider(body)
    toolset = check_request(body, prov)
    counter = shared_counter(encoding or DEFAULT_ENCODING)
    layout = token_layout(body, prov, counter, toolset)
    targets = scan_targets(body, layout.segments, toolset)
    spans = {t.path: detect(t.text, t.path) for t in targets}
    findings = _pattern_findings(targets, spans, layout, counter)
    match = FamilyMatch(None, [])
    if learner is not None:
        match = learner.observe(targets, spans, list(toolset.labels))
        findings += _learned_findings(match, targets, spans, layout, counter)
    tool_found, resolved = tool_findings(body, prov, layout, match.family, toolset)
    findings += tool_found
    tracker = session if isinstance(session, SessionTracker) else (
        learner.sessions if learner is not None else None)
    if tracker is not None:
        key = session_key(body, match.family.id if match.family else None, session)
        findings += history_findings(body, layout, tracker, key)
    cacheable = _first_break(findings, layout.total)
    after = _after_fix(body, prov, findings, resolved, layout, counter)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    findings += minimum_findings(prov, model, layout.total, cacheable, after)
    if prov == "anthropic":
        findings += cache_control_findings(body, model, layout, cacheable)
    return LintReport(findings, layout.total, cacheable, after,
                      match.family.id if match.family else None, prov)


def learn_request(body: dict[str, Any], learner: TemplateLearner,
                  provider: Provider | None = None) -> str | None:
    """Feed one request to the learner without linting it (first pass over a
    log); returns its family id."""
    prov = provider or detect_provider(body)
    toolset = check_request(body, prov)
    targets = scan_targets(body, segments(body, prov, toolset), toolset)
    spans = {t.path: detect(t.text, t.path) for t in targets}
    match = learner.observe(targets, spans, list(toolset.labels))
    return match.family.id if match.family else None


def session_key(body: dict[str, Any], family: str | None,
                session: SessionTracker | str | None) -> str:
    """The explicit session string, else family + first non-system message."""
    if isinstance(session, str):
        return "s:" + session
    first: Any = next((m for m in body["messages"] if m.get("role") not in {"system", "developer"}),
                 {})
    return "a:" + fingerprint(family or "", compact_json(first))


def _token_offsets(target: Segment, starts: list[int], layout: TokenLayout,
                   counter: TokenCounter) -> list[int | None]:
    i = layout.paths.get(target.path)
    if i is None:  # a tool description: report the tool's start
        return [layout.start_of(target.path.split(".", 1)[0])] * len(starts)
    return [layout.starts[i] + n
            for n in counter.count_prefixes_at(target.text, target.path, starts)]


def _pattern_findings(targets: list[Segment], spans: dict[str, list[Span]],
                      layout: TokenLayout, counter: TokenCounter) -> list[Finding]:
    out = []
    for target in targets:
        found = spans[target.path]
        if not found:
            continue
        offsets = _token_offsets(target, [s.start for s in found], layout, counter)
        for s, offset in zip(found, offsets, strict=True):
            out.append(finding(_RULE_FOR_KIND[s.kind], target.path,
                               f"{s.label} in the cached prefix", start=s.start, end=s.end,
                               value=s.value, token_offset=offset))
    return out


def _learned_findings(match: FamilyMatch, targets: list[Segment],
                      spans: dict[str, list[Span]], layout: TokenLayout,
                      counter: TokenCounter) -> list[Finding]:
    by_path = {t.path: t for t in targets}
    out = []
    for ls in match.spans:
        if any(s.start < ls.end and ls.start < s.end for s in spans[ls.path]):
            continue
        target = by_path[ls.path]
        (offset,) = _token_offsets(target, [ls.start], layout, counter)
        out.append(finding("PL008", ls.path, "varies across requests of this prompt family",
                           start=ls.start, end=ls.end, value=target.text[ls.start:ls.end],
                           token_offset=offset))
    return out


def _first_break(findings: list[Finding], total: int) -> int:
    offsets = [f.token_offset for f in findings
               if f.rule in BREAKING_RULES and f.token_offset is not None]
    return min(offsets, default=total)


def context_target(body: dict[str, Any], provider: Provider) -> int | None:
    """Index of the message that receives the context block (the last user turn)."""
    messages = body["messages"]
    turn_roles = {"user", "tool"} if provider == "openai" else {"user"}
    if messages and messages[-1].get("role") in turn_roles:
        return len(messages) - 1
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    return users[-1] if users else None


def _after_fix(body: dict[str, Any], provider: Provider, findings: list[Finding],
               resolved: set[str], layout: TokenLayout, counter: TokenCounter) -> int:
    """Estimate of the cacheable prefix once rewrite_request has run."""
    moved = [f for f in findings if f.kind in DYNAMIC_KINDS and f.start is not None]
    breaks = [f.token_offset for f in findings if f.rule in BREAKING_RULES
              and f.kind not in DYNAMIC_KINDS and f.rule not in resolved
              and f.token_offset is not None]
    limit = min(breaks, default=layout.total)
    if not moved:
        return limit
    target = context_target(body, provider)
    at = layout.total if target is None else layout.message_start(target)
    saved = sum(counter.count(f.value) - MARKER_TOKENS for f in moved
                if f.token_offset is not None and f.token_offset < at)
    return max(0, min(limit, at - max(saved, 0)))
