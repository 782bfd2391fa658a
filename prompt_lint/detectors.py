"""Pattern detectors: values that change per request, found by their shape.

Each detector is a compiled regex plus an optional validator; a match
becomes a `Span(kind, start, end, value, label)`. Patterns never cross a
line, so detection runs per line through a cache bounded by bytes (system
prompts repeat almost all their lines from request to request). Stable look-alikes
(version numbers such as 1.2.3 or v2026.11, code, plain prose) are rejected
by anchoring: dates need a valid month and day, hex needs both digits and
letters, epochs must fall in 2017..2033, high-entropy tokens need mixed
character classes.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from itertools import compress
from typing import Any, NamedTuple

from prompt_lint.budgets import BUDGETS, MemoBudgets
from prompt_lint.incremental import PieceMemo
from prompt_lint.memo import LRU, text_bytes
from prompt_lint.tokens import LONG_TEXT, slot_keys


class Span(NamedTuple):
    """A detected value: kind (rule kind), character span, raw text, detector label."""

    kind: str
    start: int
    end: int
    value: str
    label: str


_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|"
           "December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec")
_DAYS = "Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday|Mon|Tue|Wed|Thu|Fri|Sat|Sun"
_ISO_TIME = r"(?:[T ][0-2]\d:[0-5]\d(?::[0-5]\d(?:[.,]\d{1,9})?)?(?:Z|[+-][0-2]\d:?[0-5]\d)?)?"
_CLOCK = r"[0-2]?\d:[0-5]\d(?::[0-5]\d)?(?:\s?[AaPp]\.?[Mm]\.?)?(?:\s?(?:UTC|GMT|Z|[A-Z]{3,4}T))?"
_ID_LABELS = ("session|user|request|req|trace|span|conversation|convo|thread|run|correlation|"
              "account|customer|tenant|org|device|client|chat|message|msg|order|job|visitor|"
              "transaction|tx|call|invocation|execution")

Validator = Callable[[re.Match[str]], bool]


class Detector(NamedTuple):
    """A named pattern; `group` selects the value inside the match; `confidence` is how
    likely a match is a per-request value when the family gives no evidence (a UUID
    almost always is; a bare clock time or date is often a stable office hour or
    policy date)."""

    label: str
    kind: str
    pattern: re.Pattern[str]
    group: int = 0
    valid: Validator | None = None
    confidence: float = 0.9


def _valid_iso(m: re.Match[str]) -> bool:
    month, day = int(m.group(2)), int(m.group(3))
    return 1 <= month <= 12 and 1 <= day <= 31


def _valid_dmy(m: re.Match[str]) -> bool:
    a, b = int(m.group(1)), int(m.group(2))
    return (1 <= a <= 31 and 1 <= b <= 12) or (1 <= a <= 12 and 1 <= b <= 31)


def _valid_clock(m: re.Match[str]) -> bool:
    text = m.group(0)
    hours, rest = text.split(":", 1)
    if int(hours) > 23:
        return False
    has_suffix = len(rest) > 2  # seconds, AM/PM or a zone after the minutes
    return len(hours) == 2 or has_suffix


def _valid_hex(m: re.Match[str]) -> bool:
    text = m.group(0)
    return any(c.isdigit() for c in text) and any(c.isalpha() for c in text)


def entropy(text: str) -> float:
    """Shannon entropy in bits per character."""
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values())


def _valid_random(m: re.Match[str]) -> bool:
    text = m.group(0)
    digits = sum(c.isdigit() for c in text)
    upper = sum(c.isupper() for c in text)
    lower = sum(c.islower() for c in text)
    classes = (digits >= 2) + (upper >= 2) + (lower >= 2)
    return (classes >= 3 or (classes == 2 and digits >= 4)) and entropy(text) >= 3.5


def _valid_labelled(m: re.Match[str]) -> bool:
    value = m.group(1)
    return any(c.isdigit() for c in value) or len(value) >= 8


def _d(label: str, kind: str, pattern: str, group: int = 0,
       valid: Validator | None = None, flags: int = 0, confidence: float = 0.9) -> Detector:
    return Detector(label, kind, re.compile(pattern, flags), group, valid, confidence)


DETECTORS: tuple[Detector, ...] = (
    _d("JWT", "identifier", r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    _d("API key", "identifier",
       r"\b(?:sk-ant-|sk-proj-|sk-|pk_live_|sk_live_|pk_test_|sk_test_|rk_|ghp_|gho_|ghs_|"
       r"xox[abps]-|AIza|AKIA)[A-Za-z0-9_-]{16,}"),
    _d("UUID", "identifier",
       r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    _d("email", "identifier",
       r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b",
       confidence=0.6),
    _d("RFC 2822 date", "timestamp",
       rf"\b(?:(?:{_DAYS}),\s)?\d{{1,2}}\s(?:{_MONTHS})\s\d{{4}}\s\d{{2}}:\d{{2}}(?::\d{{2}})?"
       r"(?:\s(?:[+-]\d{4}|GMT|UTC|[A-Z]{3}))?"),
    _d("ISO 8601 timestamp", "timestamp", rf"\b(\d{{4}})-(\d{{2}})-(\d{{2}}){_ISO_TIME}(?!\d|\.\d)",
       valid=_valid_iso),
    _d("date and time", "timestamp",
       rf"\b(\d{{1,2}})[/.](\d{{1,2}})[/.]\d{{4}}(?:,?\s{_CLOCK})?\b", valid=_valid_dmy,
       confidence=0.6),
    _d("written date", "timestamp",
       rf"\b(?:(?:{_DAYS}),?\s)?(?:(?:{_MONTHS})\.?\s\d{{1,2}}(?:st|nd|rd|th)?,?\s\d{{4}}|"
       rf"\d{{1,2}}(?:st|nd|rd|th)?\s(?:of\s)?(?:{_MONTHS}),?\s\d{{4}})(?:,?\s(?:at\s)?{_CLOCK})?",
       confidence=0.5),
    _d("weekday and time", "timestamp", rf"\b(?:{_DAYS}),?\s(?:at\s)?{_CLOCK}",
       confidence=0.6),
    _d("Unix epoch (ms)", "timestamp", r"(?<![\d.])1[5-9]\d{11}(?!\d|\.\d)", confidence=0.85),
    _d("Unix epoch", "timestamp", r"(?<![\d.\w])1[5-9]\d{8}(?!\d|\.\d)", confidence=0.7),
    _d("clock time", "timestamp", rf"(?<![\d:.])\b{_CLOCK}(?![\d:])", valid=_valid_clock,
       confidence=0.4),
    _d("labelled id", "identifier",
       rf"\b(?:{_ID_LABELS})[ _-]?(?:id|key|token|uuid|number|no)\b[\"']?[ \t]*[:=#][ \t]*[\"']?"
       r"([A-Za-z0-9][A-Za-z0-9._:@+/-]{3,})", group=1, valid=_valid_labelled, flags=re.I),
    _d("nonce", "nonce",
       r"\b(?:nonce|salt|seed|cache[_ -]?buster|counter|request[_ ]?(?:count|seq)|"
       r"turn[_ ]?(?:number|count)|retry[_ ]?count|attempt[_ ]?(?:number|no))\b[\"']?[ \t]*"
       r"[:=#][ \t]*[\"']?([A-Za-z0-9+/_=-]+)", group=1, flags=re.I),
    _d("request counter", "nonce", r"\b(?:[Rr]equest|[Tt]urn|[Cc]all|[Rr]un)\s#(\d+)\b", group=1),
    _d("hex digest", "identifier", r"\b[0-9a-fA-F]{16,128}\b", valid=_valid_hex,
       confidence=0.6),
    _d("high-entropy token", "nonce", r"(?<![\w/.-])[A-Za-z0-9+/_-]{20,}={0,2}(?![\w/.-])",
       valid=_valid_random, confidence=0.7),
)


#: Cheap necessary conditions per detector label: (substrings of which the line must
#: hold one, whether the line must hold a digit). A detector whose pattern (and
#: validator) cannot match without them is skipped; results are unchanged.
_NEEDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "JWT": (("eyJ",), False),
    "API key": (("sk-", "pk_", "sk_", "rk_", "ghp_", "gho_", "ghs_", "xox", "AIza", "AKIA"),
                False),
    "UUID": (("-",), False),
    "email": (("@",), False),
    "RFC 2822 date": ((":",), True),
    "ISO 8601 timestamp": (("-",), True),
    "date and time": (("/", "."), True),
    "written date": ((), True),
    "weekday and time": ((":",), True),
    "Unix epoch (ms)": (("1",), True),
    "Unix epoch": (("1",), True),
    "clock time": ((":",), True),
    "labelled id": ((":", "=", "#"), False),
    "nonce": ((":", "=", "#"), False),
    "request counter": (("#",), True),
    "hex digest": ((), True),  # the validator wants a digit
    "high-entropy token": ((), True),  # the validator wants at least two digits
}

_MONTH_STEMS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
                "Dec")
_DAY_STEMS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
#: A second necessary condition for the patterns built on word alternations (the slow
#: ones): a stem every alternative contains (month and day names hold their
#: three-letter stem; case-insensitive where the pattern is).
_STEMS: dict[str, tuple[tuple[str, ...], int]] = {
    "RFC 2822 date": (_MONTH_STEMS, 0),
    "written date": (_MONTH_STEMS, 0),
    "weekday and time": (_DAY_STEMS, 0),
    "labelled id": (("id", "key", "token", "number", "no"), re.I),
    "nonce": (("nonce", "salt", "seed", "cache", "count", "seq", "number", "attempt"), re.I),
}


def _needs_pattern(needs: tuple[str, ...], flags: int = 0) -> re.Pattern[str] | None:
    return re.compile("|".join(map(re.escape, needs)), flags) if needs else None


class _Step(NamedTuple):
    detector: Detector
    needs: re.Pattern[str] | None
    digit: bool
    stems: re.Pattern[str] | None


_PLAN: tuple[_Step, ...] = tuple(
    _Step(d, _needs_pattern(_NEEDS.get(d.label, ((), False))[0]),
          _NEEDS.get(d.label, ((), False))[1],
          _needs_pattern(*_STEMS[d.label]) if d.label in _STEMS else None) for d in DETECTORS)
_DIGIT = re.compile(r"\d")


def _detect_line(line: str) -> list[Span]:
    taken: list[tuple[int, int]] = []
    spans: list[Span] = []
    has_digit = _DIGIT.search(line) is not None
    for det, needs, digit, stems in _PLAN:
        if (digit and not has_digit) or (needs is not None and needs.search(line) is None) or \
                (stems is not None and stems.search(line) is None):
            continue
        for m in det.pattern.finditer(line):
            if det.valid is not None and not det.valid(m):
                continue
            start, end = m.span(det.group)
            if any(start < e and s < end for s, e in taken):
                continue
            taken.append((start, end))
            spans.append(Span(det.kind, start, end, line[start:end], det.label))
    spans.sort(key=lambda s: s.start)
    return spans


def lines_with_ends(text: str) -> list[str]:
    """`text` cut after every newline (the newline stays with its line)."""
    parts = text.split("\n")
    last = parts.pop()
    return [p + "\n" for p in parts] + ([last] if last else [])


def spans_bytes(spans: list[Span]) -> int:
    """Estimated bytes of a list of spans (list slots, Span tuples, their values)."""
    return 56 + sum(_SPAN_BYTES + len(s.value) for s in spans) if spans else 56


def _lines_spans_bytes(values: list[list[Span]]) -> int:
    return 56 * len(values) + _SPAN_BYTES * sum(map(len, values)) + 64


_SPAN_BYTES = 200  # a Span: tuple of five, two boxed ints, kind/label shared, value's header


class PatternScanner:
    """Runs DETECTORS over texts line by line, with a line cache; long texts are scanned
    incrementally against the last text seen at the same slot. Every cache is bounded by
    bytes (`MemoBudgets.pattern_lines`, `pattern_texts`, `pattern_pieces`)."""

    def __init__(self, max_lines: int = 65536, budgets: MemoBudgets = BUDGETS) -> None:
        self._cache: LRU[str, list[Span]] = LRU(max_lines, max_weight=budgets.pattern_lines)
        self._texts: LRU[str, list[Span]] = LRU(max(max_lines // 16, 1),
                                                max_weight=budgets.pattern_texts)
        self._memo: PieceMemo[list[Span]] = PieceMemo(
            lines_with_ends, lambda line: self.line_spans(line.rstrip("\n")),
            max_bytes=budgets.pattern_pieces, values_bytes=_lines_spans_bytes)

    def memos(self) -> dict[str, LRU[Any, Any]]:
        """The byte-bounded caches by budget name (for accounting and tests)."""
        return {"pattern_lines": self._cache, "pattern_texts": self._texts,
                "pattern_pieces": self._memo.slots}

    def scan_at(self, text: str, slot: str) -> list[Span]:
        """scan(text), incrementally for long texts; `slot` names where the text lives."""
        if len(text) < LONG_TEXT:
            return self.scan(text)
        found = self._memo.get(text, slot_keys(text, slot))
        out: list[Span] = []
        for i in compress(range(len(found.values)), found.values):
            pos = found.starts[i]
            out += [s._replace(start=s.start + pos, end=s.end + pos) for s in found.values[i]]
        return out

    def line_spans(self, line: str) -> list[Span]:
        """Spans in one line (cached)."""
        spans = self._cache.get(line)
        if spans is None:
            spans = _detect_line(line)
            self._cache.put(line, spans, text_bytes(line) + spans_bytes(spans))
        return spans

    def scan(self, text: str) -> list[Span]:
        """All spans in `text`, offsets relative to `text` (whole texts cached too)."""
        found = self._texts.get(text)
        if found is None:
            found = self._scan(text)
            self._texts.put(text, found, text_bytes(text) + spans_bytes(found))
        return found

    def _scan(self, text: str) -> list[Span]:
        out: list[Span] = []
        pos = 0
        for line in text.split("\n"):
            for s in self.line_spans(line):
                out.append(s._replace(start=s.start + pos, end=s.end + pos))
            pos += len(line) + 1
        return out


#: The process-wide scanner (its memos are budgeted by `MemoBudgets`).
SCANNER = PatternScanner()


def detect(text: str, slot: str | None = None) -> list[Span]:
    """Spans of dynamic-looking values in `text` (process-wide line cache); with
    `slot` (the text's path), long texts are scanned incrementally."""
    return SCANNER.scan(text) if slot is None else SCANNER.scan_at(text, slot)
