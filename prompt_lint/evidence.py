"""Evidence first: a prompt family's own requests decide what is dynamic.

With a learner that has seen the family, a value is dynamic because it
varied across the family's requests and stable because it did not, whatever
it looks like: a pattern span on a settled path (see
`templates.FamilyMatch.settled`) that never varied is a stable look-alike and
is not reported; one that varied keeps its pattern kind (or becomes
`session` when it only varies across sessions) with confidence 1.0. Only
without evidence do patterns decide alone, and then with the detector's
confidence, raised by a cue such as "current time" or "today" before the value.

`FIX_CONFIDENCE` is the line between what `rewrite_request` moves (and what
is an error) and what is only reported as a warning. A value that was the same
in two sessions before any session showed a second request is half as likely
(`PARTIAL`): a look-alike usually, a per-request counter sometimes; what falls
below `REPORT_FLOOR` that way is not reported.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from prompt_lint.detectors import DETECTORS, Span
from prompt_lint.templates import FamilyMatch, LearnedSpan

#: Findings at or above this confidence are moved by the rewriter and keep their
#: rule's severity; below it they are warnings and stay where they are.
FIX_CONFIDENCE = 0.8
#: Confidence of a value the family's requests were seen to vary.
EVIDENCE = 1.0
#: Factor on a pattern's confidence when the value was the same in two sessions but no
#: session has shown its second request yet (some evidence of stability, not enough).
PARTIAL = 0.5
#: Pattern matches whose confidence falls below this (a bare clock time or date that
#: two sessions shared) are not reported at all.
REPORT_FLOOR = 0.3
_CONFIDENCE = {d.label: d.confidence for d in DETECTORS}
_CUE = re.compile(r"(?:\b(?:current|currently|now|today|tonight|as of|generated|requested|"
                  r"sent|received|timestamp|local time)\b|\btime\s*[:=]|\bdate\s*[:=])[^\n]*$",
                  re.IGNORECASE)
_CUE_WINDOW = 48


class Dynamic(NamedTuple):
    """One value to report: where, its finding kind, detector label, confidence."""

    path: str
    start: int
    end: int
    kind: str
    label: str
    confidence: float
    evidence: bool


def pattern_confidence(span: Span, text: str) -> float:
    """How likely `span` is a per-request value with no evidence from its family."""
    base = _CONFIDENCE.get(span.label, 0.9)
    if span.kind != "timestamp":
        return base
    if ":" not in span.value and "epoch" not in span.label:
        base = min(base, 0.5)  # a date alone: as often a policy date as today's
    line_start = text.rfind("\n", 0, span.start) + 1
    before = text[max(line_start, span.start - _CUE_WINDOW):span.start]
    return min(0.95, base + 0.35) if _CUE.search(before) else base


def _overlaps(a: Span | LearnedSpan, b: LearnedSpan) -> bool:
    return a.start < b.end and b.start < a.end


def decide(path: str, text: str, spans: list[Span], match: FamilyMatch) -> list[Dynamic]:
    """The dynamic values of the string at `path`: pattern spans judged by the family's
    evidence, then learned spans no pattern names."""
    learned = [ls for ls in match.spans if ls.path == path]
    settled = path in match.settled
    out: list[Dynamic] = []
    for s in spans:
        seen = [ls for ls in learned if _overlaps(s, ls)]
        if seen:
            kind = "session" if all(ls.scope == "session" for ls in seen) else s.kind
            out.append(Dynamic(path, s.start, s.end, kind, s.label, EVIDENCE, True))
        elif not settled:
            confidence = pattern_confidence(s, text) * (PARTIAL if path in match.partial else 1)
            if confidence >= REPORT_FLOOR:
                out.append(Dynamic(path, s.start, s.end, s.kind, s.label, confidence, False))
    for ls in learned:
        if not any(_overlaps(s, ls) for s in spans):
            kind = "session" if ls.scope == "session" else "learned"
            out.append(Dynamic(path, ls.start, ls.end, kind, "learned", EVIDENCE, True))
    out.sort(key=lambda d: d.start)
    return out
