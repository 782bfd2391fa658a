"""Values at the top of a conversation's first user message, before text its sessions share.

Agents often open every conversation with a user message that carries the same long material
(a guide, a document, a code listing) under a line that changes per session: `Current time:
...`, `user_id: ...`. That message is history in every later turn, so inside one session the
value is reused; across sessions it ends the shared prefix right there, before the material
every session sends, and each session caches that material again.

The family remembers the opening messages of its last sessions (`OPENINGS_PER_FAMILY`, each
cut at `OPENING_CHARS`). A line of this request's opening that holds a pattern value
(`detectors`) and is not a line of another session's opening, or that differs from its
counterpart there by one run of at most `VALUE_WORDS` words (a name no pattern knows), is moved
to the end of the message, in both openings, and the two are compared: when at least
`MIN_SHARED_TOKENS` of the text after the line's place are then shared, the line is reported
(PL014) with that evidence, and `prefixgate fix` moves it there (`moved_to_end`, the same text
the comparison used). A date in a user's own question, whose following text differs per
session, is not reported. Each comparison is memoised per family (`Family.opening_memo`): the
turns of a session resend the same opening.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any, NamedTuple

from prompt_lint.align import line_pairs, words
from prompt_lint.checks import finding
from prompt_lint.detectors import Span, detect, lines_with_ends
from prompt_lint.evidence import LIKELY, pattern_confidence
from prompt_lint.family import Family
from prompt_lint.layout import TokenLayout
from prompt_lint.memo import text_bytes
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
_WORD = re.compile(r"\w")


class Opening(NamedTuple):
    """The first non-system message of a request when it is a user's: its index, the path and
    text of its first text part, and the text's hash (the session's key here: in-process
    state only, so Python's salted string hash serves, and costs far less than a digest)."""

    message: int
    path: str
    text: str
    key: int


class OpeningCheck(NamedTuple):
    """PL014 findings of one request, and what its opening text shares with the closest other
    session's (in tokens, from the text's start `start`; 0 below `MIN_SHARED_TOKENS`): as sent
    (`shared_now`) and once `fix` moved the reported lines (`shared_after`)."""

    findings: list[Finding]
    start: int = 0
    shared_now: int = 0
    shared_after: int = 0
    message: int | None = None  # the opening's message index, when its text is shared

    @property
    def shared(self) -> bool:
        """Whether the family's sessions share this opening's text (then a context block the
        fix gives it goes at its end, below that text)."""
        return bool(self.shared_now or self.shared_after)


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
    return Opening(k, path, text, hash(text[:OPENING_CHARS]))


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


def _others(family: Family, key: int, frozen: bool) -> list[tuple[int, str]]:
    """The openings (key, text) of other sessions to compare with: all of them once the whole
    log was learned, else those of the sessions seen before this one (the same in each of its
    turns)."""
    if frozen or key not in family.openings:
        return [(k, text) for k, text in family.openings.items() if k != key]
    before: list[tuple[int, str]] = []
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
    tokens each sharing session shares after it, its values and the tokens before the first;
    the tokens the closest other session shares as sent and after the fix."""

    shares: dict[int, list[int]]
    spans: dict[int, list[Span]]
    offsets: dict[int, int]
    now: int
    after: int


#: Judgements a family keeps (`Family.opening_memo`, least recently used dropped): every turn
#: of a session resends its opening; as many as the sessions a family remembers.
MEMO_ENTRIES = 128
#: Words of a line that may differ from the other session's line for the difference to be one
#: value no pattern names (a user's name, a plan), not the user's own words.
VALUE_WORDS = 3


def check_opening(opening: Opening | None, family: Family, frozen: bool, layout: TokenLayout,
                  counter: TokenCounter) -> OpeningCheck:
    """PL014 for a request's opening message (`opening_of`), judged against the family's other
    sessions' openings (see the module docstring)."""
    start = layout.start_of(opening.path) if opening is not None else None
    if opening is None or start is None:
        return OpeningCheck([])
    others = _others(family, opening.key, frozen)
    # learning online, a session's first judgement stands for all its turns (the sessions
    # remembered rotate under a busy family: judged again, it would cost every request a
    # comparison, and its findings could change mid-session); a whole log's, per set compared
    memo_key = (opening.key, tuple(key for key, _ in others) if frozen else ())
    judged = family.opening_memo.get(memo_key)
    text = opening.text[:OPENING_CHARS]
    if judged is None:
        judged = _judge(text, [other for _, other in others], counter)
        family.opening_memo[memo_key] = judged
        while len(family.opening_memo) > MEMO_ENTRIES:
            family.opening_memo.popitem(last=False)
    else:
        family.opening_memo.move_to_end(memo_key)
    many = len(family.openings) >= OPENINGS_PER_FAMILY  # more sessions than it remembers
    findings = [_finding(opening, text, judged.spans[line], shared,
                         start + judged.offsets[line], many)
                for line, shared in sorted(judged.shares.items())]
    shared = judged.now or judged.after
    return OpeningCheck(findings, start, judged.now, judged.after,
                        opening.message if shared else None)


class _Compared(NamedTuple):
    """This opening against one other: the lines moved in each, and its text once fixed."""

    mine: dict[int, list[Span]]
    theirs: set[int]
    fixed: str


def _compare(text: str, valued: dict[int, list[Span]], other: str) -> _Compared:
    """The lines the fix would move in `text` and in `other` when the two are compared: valued
    lines that are no line of the other, and lines that differ from their counterpart by a
    value no pattern names."""
    learned, theirs = _learned(text, other)
    lines = set(other.split("\n"))
    mine = {i: valued[i] for i in _varying(text, valued, lines)}
    for i, span in learned.items():
        mine.setdefault(i, [span])
    theirs |= _varying(other, _valued_lines(other), set(text.split("\n")))
    return _Compared(mine, theirs, moved_to_end(text, set(mine)))


def _judge(text: str, others: list[str], counter: TokenCounter) -> Judged:
    """Compare `text` with each other opening: a line the fix moves (`_compare`) that leaves at
    least `MIN_SHARED_TOKENS` shared after its place is reported."""
    shares: dict[int, list[int]] = {}
    spans: dict[int, list[Span]] = {}
    compared: list[tuple[str, _Compared, int]] = []  # other, the comparison, tokens shared
    mine = text.split("\n")
    alike = [other for other in others if _may_share(mine, other.split("\n"))]
    # the patterns are looked for only in an opening that may share text with another: a
    # session's own task shares none, and scanning its long lines was most of the cost
    valued = _valued_lines(text) if alike else {}
    for other in alike:
        pair = _compare(text, valued, other)
        common = _common(pair.fixed, moved_to_end(other, pair.theirs))
        lines = sorted(pair.mine)
        places = [_place(text, set(lines), line) for line in lines]
        counts = counter.count_prefixes(pair.fixed[:common],
                                        [common, *(min(p, common) for p in places)])
        compared.append((other, pair, counts[0]))
        for line, upto in zip(lines, counts[1:], strict=True):
            if counts[0] - upto >= MIN_SHARED_TOKENS:
                shares.setdefault(line, []).append(counts[0] - upto)
                spans[line] = pair.mine[line]
    lines = sorted(shares)
    raw = max((_common(text, o) for o in others), default=0)
    # a token is a character at least: a shorter common prefix holds too few tokens to count
    ends = [spans[k][0].start for k in lines] + ([raw] if raw >= MIN_SHARED_TOKENS else [])
    counts = counter.count_prefixes(text, ends) if ends else []
    now = max(counts[len(lines):], default=0)
    after = max((_shared_after(text, set(lines), other, pair, n, counter)
                 for other, pair, n in compared), default=0) if lines else 0
    return Judged(shares, spans, dict(zip(lines, counts, strict=False)),
                  now if now >= MIN_SHARED_TOKENS else 0,
                  after if after >= MIN_SHARED_TOKENS else 0)


def _may_share(a: list[str], b: list[str]) -> bool:
    """Whether two openings (their lines) may share `MIN_SHARED_TOKENS` once lines are moved:
    they have a non-blank line in common, or two lines at the same place that begin alike (a
    long line that differs only at its end); openings of other line counts are compared in
    full."""
    if len(a) != len(b) or any(line.strip() for line in set(a).intersection(b)):
        return True
    return any(x[:MIN_SHARED_TOKENS] == y[:MIN_SHARED_TOKENS] and len(x) > MIN_SHARED_TOKENS
               for x, y in zip(a, b, strict=True))


def _learned(text: str, other: str) -> tuple[dict[int, Span], set[int]]:
    """Lines of `text` that differ from their counterpart in `other` (aligned line by line) by
    one run of at most `VALUE_WORDS` words, with a word kept: the span of that run, by line;
    and the counterparts' line numbers in `other`."""
    a, b = text.split("\n"), other.split("\n")
    others = set(b)
    if all(line in others or not line.strip() for line in a):
        return {}, set()
    starts = list(accumulate((len(line) + 1 for line in a), initial=0))
    pairs = zip(range(len(a)), range(len(b)), strict=True) if len(a) == len(b) else \
        ((i, j) for j, i in line_pairs(b, a)[0])
    mine: dict[int, Span] = {}
    theirs: set[int] = set()
    for i, j in pairs:
        run = _one_run(a[i], b[j]) if a[i] != b[j] and a[i].strip() else None
        if run is not None:
            lo, hi = starts[i] + run[0], starts[i] + run[1]
            mine[i] = Span("session", lo, hi, text[lo:hi], "value learned from the sessions")
            theirs.add(j)
    return mine, theirs


def _one_run(x: str, y: str) -> tuple[int, int] | None:
    """The span in `x` of the words where it differs from `y`, when that is one run of at most
    `VALUE_WORDS` words (in both) and some word of `x` is outside it; else None."""
    head = _common(x, y)
    tail = _common(x[head:][::-1], y[head:][::-1])
    while head > 0 and x[head - 1].isalnum():  # back to the start of the word
        head -= 1
    end_x, end_y = len(x) - tail, len(y) - tail
    while end_x < len(x) and x[end_x].isalnum():
        end_x += 1
    while end_y < len(y) and y[end_y].isalnum():
        end_y += 1
    if len(x[head:end_x].split()) > VALUE_WORDS or len(y[head:end_y].split()) > VALUE_WORDS:
        return None  # the user's own words (checked cheaply first: they are long)
    found, n_y = words(x[head:end_x]), len(words(y[head:end_y]))
    kept = _WORD.search(x, 0, head) or _WORD.search(x, end_x)
    if not 0 < len(found) <= VALUE_WORDS or n_y > VALUE_WORDS or kept is None:
        return None
    return head + found[0][0], head + found[-1][1]


def _shared_after(text: str, lines: set[int], other: str, pair: _Compared, shared: int,
                  counter: TokenCounter) -> int:
    """Tokens `text` shares with `other` once the fix moved `lines` (`shared`, counted when
    the comparison moved the same lines)."""
    if set(pair.mine) == lines:
        return shared
    fixed = moved_to_end(text, lines)
    return counter.count_prefixes(fixed, [_common(fixed, moved_to_end(other, pair.theirs))])[0]


def _finding(opening: Opening, text: str, spans: list[Span], shared: list[int], offset: int,
             many: bool) -> Finding:
    """The PL014 finding of one line: its values' span, the sessions that share text after it
    (`many`: the family saw more sessions than it remembers) and the fewest tokens they share."""
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
