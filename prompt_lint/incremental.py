"""Incremental piecewise processing of texts that mostly repeat.

Prompts in a log repeat almost all their text from one request to the next
(the same system prompt with a new timestamp). A `PieceMemo` keeps, per slot,
the last text cut into pieces with a value per piece (token count, spans).
For a new text it finds the common prefix and suffix with the remembered
text (binary search over slice comparisons, so C speed), reuses the pieces
that lie wholly inside them and recomputes only the pieces in between.

A cutter must be local: a cut point depends only on the characters just
before and after it (a newline, then anything / a non-space), so a piece
whose boundaries and neighbouring characters are unchanged is unchanged.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from itertools import accumulate
from typing import AnyStr, Generic, NamedTuple, TypeVar

from prompt_lint.memo import LRU, approx_bytes, caching, text_bytes

V = TypeVar("V")


class Pieces(NamedTuple, Generic[V]):
    """A text cut into pieces: `starts[i]` is piece i's offset, `starts[-1] == len(text)`."""

    text: str
    pieces: list[str]
    starts: list[int]
    values: list[V]


_BLOCK = 64


def common_prefix(a: AnyStr, b: AnyStr) -> int:
    """Length of the longest common prefix of two strings (or two byte strings): galloping
    (compare prefixes of doubling length, C-speed slice equality), then binary search
    between the last two lengths."""
    n = min(len(a), len(b))
    lo, step = 0, _BLOCK
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_suffix(a: str, b: str, limit: int) -> int:
    """Length of the longest common suffix, at most `limit` (galloping, as common_prefix)."""
    n = min(len(a), len(b), limit)
    la, lb = len(a), len(b)
    lo, step = 0, _BLOCK
    while lo < n:
        hi = min(lo + step, n)
        if a[la - hi:la - lo] != b[lb - hi:lb - lo]:
            break
        lo, step = hi, step * 2
    else:
        return n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[la - mid:la - lo] == b[lb - mid:lb - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_LAST_BOUNDS: list[tuple[str, str, int, int]] = []


def shared_bounds(old: str, new: str) -> tuple[int, int]:
    """(common prefix, common suffix not overlapping it) of `old` and `new`; the last
    pair is remembered by identity (strings are immutable), so the memos of one
    request (tokens, patterns) that hold the same previous text compare it once."""
    if _LAST_BOUNDS and caching():
        last_old, last_new, a, b = _LAST_BOUNDS[0]
        if last_old is old and last_new is new:
            return a, b
    a = common_prefix(old, new)
    b = common_suffix(old, new, min(len(old), len(new)) - a)
    _LAST_BOUNDS[:] = [(old, new, a, b)]
    return a, b


_STR_HEADER = 64  # a str object beside its characters (49..80 bytes)


def _numbers_bytes(values: list[V]) -> int:
    """A list of numbers: its slots and a boxed number each (O(1))."""
    return sys.getsizeof(values) + 32 * len(values)


class PieceMemo(Generic[V]):
    """Bounded memo: slot -> last Pieces; `cut` splits text, `value` maps a piece.

    Bounded by `max_bytes` (an LRU over slots; a Pieces weighs its text, its pieces, their
    offsets and `values_bytes` of its values (default: numbers), counted once per slot that
    holds it) and by
    `max_slots` entries."""

    def __init__(self, cut: Callable[[str], list[str]], value: Callable[[str], V],
                 max_slots: int = 1024, max_bytes: int = 16 << 20,
                 values_bytes: Callable[[list[V]], int] | None = None) -> None:
        self._cut = cut
        self._value = value
        self._values_bytes = values_bytes or _numbers_bytes
        self.slots: LRU[object, Pieces[V]] = LRU(max_slots, max_weight=max_bytes)

    def get(self, text: str, slots: tuple[object, ...]) -> Pieces[V]:
        """`text` in pieces, reusing whatever the first remembered slot shares with it."""
        if not caching():
            return self._fresh(text)
        before = next((p for p in map(self.slots.get, slots) if p is not None), None)
        result = self._fresh(text) if before is None else self._reuse(before, text)
        weight = -1
        for slot in slots:
            if self.slots.get(slot) is result:  # the same text again: held (now refreshed)
                continue
            if weight < 0:
                weight = self.pieces_bytes(result)
            self.slots.put(slot, result, approx_bytes(slot) + weight)
        return result

    def pieces_bytes(self, found: Pieces[V]) -> int:
        """Estimated bytes a Pieces holds, in O(1) but for the values: the text, its pieces
        (they partition the text, so their characters are at most the text's bytes, plus a
        str header each), the offset lists and `values_bytes` of the values."""
        n = len(found.pieces)
        return (2 * text_bytes(found.text) + _STR_HEADER * n + sys.getsizeof(found.pieces) +
                sys.getsizeof(found.starts) + 32 * (n + 1) + self._values_bytes(found.values))

    def _fresh(self, text: str) -> Pieces[V]:
        pieces = self._cut(text)
        return Pieces(text, pieces, list(accumulate(map(len, pieces), initial=0)),
                      [self._value(p) for p in pieces])

    def _reuse(self, old: Pieces[V], text: str) -> Pieces[V]:
        if old.text == text:
            return old
        if not text or not old.text:
            return self._fresh(text)
        a, b = shared_bounds(old.text, text)
        starts, n = old.starts, len(old.pieces)
        head = max(bisect_left(starts, a, 1) - 1, 0)  # pieces ending strictly before a
        tail = max(bisect_right(starts, len(old.text) - b), head)  # first piece after the gap
        tail = min(tail, n)
        delta = len(text) - len(old.text)
        middle = self._cut(text[starts[head]: starts[tail] + delta]) \
            if starts[head] < starts[tail] + delta else []
        pieces = old.pieces[:head] + middle + old.pieces[tail:]
        values = old.values[:head] + [self._value(p) for p in middle] + old.values[tail:]
        return Pieces(text, pieces, list(accumulate(map(len, pieces), initial=0)), values)
