"""Precision and recall of prompt_lint's findings against the corpus labels.

Shared by the corpus tests and benchmarks/bench_lint.py (which reports the same
numbers beside its throughput table).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from prompt_lint import Finding, LintReport

from .lint_corpus import CorpusRequest, Label


class Scored(NamedTuple):
    """A corpus and one report per request."""

    corpus: list[CorpusRequest]
    reports: list[LintReport]


DYNAMIC_RULES = {"timestamp": "PL001", "identifier": "PL002", "nonce": "PL003",
                 "learned": "PL008", "session": "PL013"}
STRUCTURAL_RULES = ("PL004", "PL006", "PL009")


def overlaps(f: Finding, label: Label) -> bool:
    return f.path == label.path and f.start is not None and f.end is not None and \
        f.start < label.end and label.start < f.end


def score(linted: Scored, min_confidence: float = 0.0) -> dict[str, tuple[float, float, int]]:
    """rule -> (precision, recall, support); `dynamic` is every dynamic rule together.

    A dynamic finding is a true positive when it overlaps an injected value;
    a label is recalled for its rule when a finding of that rule overlaps it.
    Structural rules are scored per request. `min_confidence` scores only the
    findings at or above that confidence.
    """
    tp: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    fn: Counter[str] = Counter()
    support: Counter[str] = Counter()
    for req, rep in zip(linted.corpus, linted.reports, strict=True):
        dyn = [f for f in rep.findings
               if f.rule in DYNAMIC_RULES.values() and f.confidence >= min_confidence]
        for f in dyn:
            hit = any(overlaps(f, lb) for lb in req.labels)
            for key in (f.rule, "dynamic"):
                (tp if hit else fp)[key] += 1
        for lb in req.labels:
            rule = DYNAMIC_RULES[lb.kind]
            hits = [f for f in dyn if overlaps(f, lb)]
            support[rule] += 1
            support["dynamic"] += 1
            fn[rule] += not any(f.rule == rule for f in hits)
            fn["dynamic"] += not hits
        got = {f.rule for f in rep.findings}
        for rule in STRUCTURAL_RULES:
            support[rule] += rule in req.structural
            if rule in got:
                (tp if rule in req.structural else fp)[rule] += 1
            elif rule in req.structural:
                fn[rule] += 1
    out = {}
    for rule in sorted(support):
        found = tp[rule] + fp[rule]
        recalled = support[rule] - fn[rule]
        out[rule] = (tp[rule] / found if found else 1.0,
                     recalled / support[rule] if support[rule] else 1.0, support[rule])
    return out


