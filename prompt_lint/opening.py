"""Values at the top of a conversation's first user message, before text its sessions share.

Agents often open every conversation with a user message that carries the same long material
(a guide, a document, a code listing) under a line that changes per session: `Current time:
...`, `user_id: ...`. That message is history in every later turn, so inside one session the
value is reused; across sessions it ends the shared prefix right there, before the material
every session sends, and each session caches that material again.

The family remembers the opening messages of its last sessions (`OPENINGS_PER_FAMILY`, each
cut at `OPENING_CHARS`). A line of this request's opening that holds a pattern value
(`detectors`) and is not a line of another session's opening is moved to the end of the
message, in both openings, and the two are compared: when at least `MIN_SHARED_TOKENS` of the
text after the line's place are then shared, the line is reported (PL014) with that evidence,
and `prefixgate fix` moves it there (`moved_to_end`, the same text the comparison used). A
date in a user's own question, whose following text differs per session, is not reported.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from prompt_lint.checks import finding
from prompt_lint.detectors import Span, detect, lines_with_ends
from prompt_lint.evidence import LIKELY, pattern_confidence
from prompt_lint.family import Family
from prompt_lint.layout import TokenLayout
from prompt_lint.memo import text_bytes
from prompt_lint.session import fingerprint
from prompt_lint.tokens import TokenCounter
from prompt_lint.types import Finding

#: Opening messages a family remembers (its most recent sessions').
OPENINGS_PER_FAMILY = 6
#: Characters of an opening message remembered and compared (a longer one is cut there).
OPENING_CHARS = 65_536
#: Tokens the sessions must share after a value's line for it to be reported: fewer are a
#: question's common first words, not material worth caching.
MIN_SHARED_TOKENS = 64
_SYSTEM_ROLES = frozenset({"system", "developer"})


class Opening(NamedTuple):
    """The first non-system message of a request when it is a user's: its index, the path and
    text of its first text part, and the text's fingerprint (the session's key here)."""

    message: int
    path: str
    text: str
    key: str


class OpeningCheck(NamedTuple):
    """PL014 findings of one request, and what its opening text shares with the closest other
    session's (in tokens, from the text's start `start`; 0 below `MIN_SHARED_TOKENS`): as sent
    (`shared_now`) and once `fix` moved the reported lines (`shared_after`)."""

    findings: list[Finding]
    start: int = 0
    shared_now: int = 0
    shared_after: int = 0


def opening_of(body: dict[str, Any]) -> Opening | None:
    """The request's opening user message's first text (None without one)."""
    messages = body["messages"]
    k = next((i for i, m in enumerate(messages) if m.get("role") not in _SYSTEM_ROLES), None)
    if k is None or messages[k].get("role") != "user":
        return None
    content = messages[k].get("content")
    if isinstance(content, str):
        path, text = f"messages[{k}].content", content
    elif isinstance(content, list) and content and isinstance(content[0], dict) and \
            isinstance(content[0].get("text"), str):
        path, text = f"messages[{k}].content[0].text", content[0]["text"]
    else:
        return None
    return Opening(k, path, text, fingerprint(text[:OPENING_CHARS]))


def record_opening(family: Family, opening: Opening) -> None:
    """Remember a session's opening in its family (kept in first-seen order, so a session is
    compared with the same earlier sessions in every turn when learning online)."""
    if opening.key in family.openings:
        return
    text = opening.text[:OPENING_CHARS]
    family.openings[opening.key] = text
    family.opening_bytes[opening.key] = text_bytes(text) + 96
    while len(family.openings) > OPENINGS_PER_FAMILY:
        dropped, _ = family.openings.popitem(last=False)
        family.opening_bytes.pop(dropped, None)


def _others(family: Family, key: str, frozen: bool) -> list[tuple[str, str]]:
    """The openings (key, text) of other sessions to compare with: all of them once the whole
    log was learned, else those of the sessions seen before this one (the same in each of its
    turns)."""
    if frozen or key not in family.openings:
        return [(k, text) for k, text in family.openings.items() if k != key]
    before: list[tuple[str, str]] = []
    for k, text in family.openings.items():
        if k == key:
            break
        before.append((k, text))
    return before


def moved_to_end(text: str, lines: set[int]) -> str:
    """`text` with its lines numbered in `lines` taken out and put, in order, at its end after
    a blank line (blank lines the move leaves at its start are dropped)."""
    parts = lines_with_ends(text)
    kept = "".join(p for i, p in enumerate(parts) if i not in lines)
    moved = "".join(parts[i] for i in sorted(lines) if i < len(parts)).rstrip("\n")
    if not moved or not kept.strip():
        return text
    return kept.lstrip("\n").rstrip("\n") + "\n\n" + moved


def _valued_lines(text: str) -> dict[int, list[Span]]:
    """Line number -> the likely pattern values on it."""
    out: dict[int, list[Span]] = {}
    for span in detect(text):
        if pattern_confidence(span, text) >= LIKELY:
            out.setdefault(text.count("\n", 0, span.start), []).append(span)
    return out


def _varying(text: str, valued: dict[int, list[Span]], other: set[str]) -> set[int]:
    """The valued lines of `text` that are no line of the other opening."""
    parts = text.split("\n")
    return {i for i in valued if parts[i] not in other}


def _common(a: str, b: str) -> int:
    """Length of the common prefix of two strings (compared a block at a time)."""
    n, at, step = min(len(a), len(b)), 0, 4096
    while at < n and a[at:at + step] == b[at:at + step]:
        at += step
    while at < n and a[at] == b[at]:
        at += 1
    return min(at, n)


def _place(text: str, lines: set[int], line: int) -> int:
    """Where the text after line `line` starts in `moved_to_end(text, lines)`."""
    parts = lines_with_ends(text)
    kept = [p for i, p in enumerate(parts) if i not in lines]
    lead = len("".join(kept)) - len("".join(kept).lstrip("\n"))
    before = sum(len(p) for i, p in enumerate(parts[: line + 1]) if i not in lines)
    return max(0, before - lead)


class Judged(NamedTuple):
    """One opening compared with the others (memoised per family): per reported line, the
    tokens each sharing session shares after it and the tokens before its first value; the
    tokens the closest other session shares as sent and after the fix."""

    shares: dict[int, list[int]]
    offsets: dict[int, int]
    now: int
    after: int


#: Comparisons a family keeps (`Family.opening_memo`): every turn of a session resends its
#: opening, compared with the same sessions.
MEMO_ENTRIES = 32


def check_opening(opening: Opening | None, family: Family, frozen: bool, layout: TokenLayout,
                  counter: TokenCounter, across: bool = True) -> OpeningCheck:
    """PL014 for a request's opening message (`opening_of`), judged against the family's other
    sessions' openings (see the module docstring). `across`: the caller needs what another
    session shares of it (`OpeningCheck.shared_now`, `shared_after`) even where nothing is
    reported."""
    start = layout.start_of(opening.path) if opening is not None else None
    if opening is None or start is None:
        return OpeningCheck([])
    text = opening.text[:OPENING_CHARS]
    valued = _valued_lines(text)
    if not valued and not across:
        return OpeningCheck([])
    others = _others(family, opening.key, frozen)
    memo_key = (opening.key, tuple(key for key, _ in others))
    judged = family.opening_memo.get(memo_key)
    if judged is None:
        judged = _judge(text, valued, [other for _, other in others], counter)
        family.opening_memo[memo_key] = judged
        while len(family.opening_memo) > MEMO_ENTRIES:
            family.opening_memo.popitem(last=False)
    many = len(family.openings) >= OPENINGS_PER_FAMILY  # more sessions than it remembers
    findings = [_finding(opening, text, valued[line], shared, start + judged.offsets[line],
                         many) for line, shared in sorted(judged.shares.items())]
    return OpeningCheck(findings, start, judged.now, judged.after)


def _judge(text: str, valued: dict[int, list[Span]], others: list[str],
           counter: TokenCounter) -> Judged:
    """Compare `text` with each other opening: a valued line of it that is no line of the
    other, moved to the end, leaves at least `MIN_SHARED_TOKENS` shared after its place."""
    shares: dict[int, list[int]] = {}
    compared: list[tuple[set[int], int]] = []  # per other: the lines moved, tokens shared then
    for other in others:
        mine = sorted(_varying(text, valued, set(other.split("\n"))))
        fixed = moved_to_end(text, set(mine))
        common = _common(fixed, _fixed_other(other, text))
        places = [_place(text, set(mine), line) for line in mine]
        counts = counter.count_prefixes(fixed, [common, *places])
        compared.append((set(mine), counts[0]))
        for line, place, upto in zip(mine, places, counts[1:], strict=True):
            if common > place and counts[0] - upto >= MIN_SHARED_TOKENS:
                shares.setdefault(line, []).append(counts[0] - upto)
    lines = sorted(shares)
    ends = [valued[k][0].start for k in lines] + [_common(text, o) for o in others]
    counts = counter.count_prefixes(text, ends)
    offsets = dict(zip(lines, counts, strict=False))
    now = max(counts[len(lines):], default=0)
    after = max((_shared_after(text, set(lines), other, moved, n, counter)
                 for other, (moved, n) in zip(others, compared, strict=True)),
                default=0) if lines else 0
    return Judged(shares, offsets, now if now >= MIN_SHARED_TOKENS else 0,
                  after if after >= MIN_SHARED_TOKENS else 0)


def _shared_after(text: str, lines: set[int], other: str, moved: set[int], shared: int,
                  counter: TokenCounter) -> int:
    """Tokens `text` shares with `other` once the fix moved `lines` (`shared`, counted with
    `moved` moved, when those are the same lines)."""
    if moved == lines:
        return shared
    fixed = moved_to_end(text, lines)
    return counter.count_prefixes(fixed, [_common(fixed, _fixed_other(other, text))])[0]


def _fixed_other(other: str, text: str) -> str:
    """Another session's opening as the fix leaves it, to compare with `text`: its valued
    lines that are no line of `text` moved to its end."""
    return moved_to_end(other, _varying(other, _valued_lines(other), set(text.split("\n"))))


def _finding(opening: Opening, text: str, spans: list[Span], shared: list[int], offset: int,
             many: bool) -> Finding:
    first, last = spans[0], spans[-1]
    what = first.label if len(spans) == 1 else f"{first.label} and {len(spans) - 1} more"
    sessions = f"{'at least ' * many}{len(shared) + 1} sessions"
    message = (f"{what} on a line of the first user message that differs across sessions, "
               f"before text they share (evidence: {sessions} share {min(shared)} tokens "
               "after it)")
    return finding("PL014", opening.path, message, start=first.start, end=last.end,
                   value=text[first.start:last.end],
                   token_offset=offset)


def opening_lines(text: str, findings: list[Finding]) -> set[int]:
    """The line numbers of `text` that the PL014 findings at its path name."""
    return {text.count("\n", 0, f.start) for f in findings if f.start is not None}


__all__ = ["MIN_SHARED_TOKENS", "OPENINGS_PER_FAMILY", "OPENING_CHARS", "Opening",
           "OpeningCheck", "check_opening", "moved_to_end", "opening_lines",
           "opening_of", "record_opening"]
