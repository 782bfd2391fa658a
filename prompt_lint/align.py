"""Line and word alignment of a new prompt against a family's reference (template learning).

Pure functions over strings: token spans of a line, the opcodes aligning two lines' tokens, the
one region a line's dynamic words cover, the values a line's dynamic pieces group into, and the
pairing of reference and new lines.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from difflib import SequenceMatcher
from itertools import accumulate, groupby
from operator import add

#: Alignment tokens: a word with its inner punctuation (a timestamp, a handle, a path)
#: or a run of punctuation, so "(light rain)." aligns as "(", "light", "rain", ")."
#: and a changing value's span stops where the value does. "=" ends a word: in
#: "uid=user_44cb63" the label and "=" are tokens of their own, so a changing value's
#: span holds the value and not the stable label before it.
_WORD_RE = re.compile(r"\w(?:[^\s=]*\w)?|[^\w\s]+")

def words(line: str) -> list[tuple[int, int]]:
    """Character spans of the alignment tokens of `line`."""
    return [m.span() for m in _WORD_RE.finditer(line)]


def word_opcodes(ref: str, new: str, rw: list[tuple[int, int]],
                  nw: list[tuple[int, int]]) -> Sequence[tuple[str, int, int, int, int]]:
    """Token alignment of two lines: position by position when they have as many
    tokens (a changed value keeps its place), else a SequenceMatcher diff."""
    if ref == new:
        return []
    a, b = [ref[s:e] for s, e in rw], [new[s:e] for s, e in nw]
    if len(a) != len(b):
        return SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    out: list[tuple[str, int, int, int, int]] = []
    for same, run in groupby(range(len(a)), key=lambda k: a[k] == b[k]):
        ks = list(run)
        op = "equal" if same else "replace"
        out.append((op, ks[0], ks[-1] + 1, ks[0], ks[-1] + 1))
    return out


def region(rw: list[tuple[int, int]], nw: list[tuple[int, int]], ref: str, new: str,
            dynamic: set[int]) -> tuple[int, int] | None:
    """One span over the new line's dynamic words: the words between the stable
    head and stable tail the reference line has around its dynamic words, so a
    line yields one span (and one marker) whatever the value's length."""
    if not dynamic or not nw:
        return None
    head, tail = min(dynamic), len(rw) - 1 - max(dynamic)
    last = len(nw) - 1 - tail
    if head > last:
        return None
    same_head = all(ref[slice(*rw[k])] == new[slice(*nw[k])] for k in range(head))
    same_tail = all(ref[slice(*rw[len(rw) - 1 - k])] == new[slice(*nw[len(nw) - 1 - k])]
                    for k in range(tail))
    return (nw[head][0], nw[last][1]) if same_head and same_tail else None


#: Stable words between two dynamic words of a line past which they are two values.
VALUE_GAP = 3

#: A changed or dynamic word of a line: (reference word, start, end in the new line).
Piece = tuple[int, int, int]


def value_groups(pieces: list[Piece], dynamic: set[int]
                 ) -> list[tuple[tuple[int, int], list[Piece]]]:
    """A line's dynamic pieces grouped into values by the reference's dynamic words: words at
    most `VALUE_GAP` stable words apart are one value (a date and its time, a tip of several
    words), farther apart two (a timestamp at a line's start, a user handle at its end), so
    the stable words between them are part of neither. The groups follow the reference, not
    each request's diff, so a line splits the same way in every request once learned. Each
    group comes with its value's first and last reference word (what the session evidence
    of that value is keyed by)."""
    bounds: list[tuple[int, int]] = []  # first and last reference word of each value
    for k in sorted(dynamic):
        if bounds and k - bounds[-1][1] <= VALUE_GAP + 1:
            bounds[-1] = (bounds[-1][0], k)
        else:
            bounds.append((k, k))
    groups: dict[int, list[Piece]] = {}
    for piece in pieces:
        nearest = min(range(len(bounds)), key=lambda g: _gap(bounds[g], piece[0]))
        groups.setdefault(nearest, []).append(piece)
    return [(bounds[g], groups[g]) for g in sorted(groups)]


def _gap(bound: tuple[int, int], word: int) -> int:
    """How many words `word` lies outside `bound` (0 inside it)."""
    return max(bound[0] - word, word - bound[1], 0)


def line_offsets(lines: list[str]) -> list[int]:
    """Offset of each line in the text the lines were split from (plus the end)."""
    return list(map(add, accumulate(map(len, lines), initial=0), range(len(lines) + 1)))


def line_pairs(ref: list[str], new: list[str]) -> tuple[list[tuple[int, int]], list[int]]:
    """Aligned (ref, new) line pairs, and new lines with no counterpart."""
    pairs: list[tuple[int, int]] = []
    extra: list[int] = []
    for op, i1, i2, j1, j2 in SequenceMatcher(None, ref, new, autojunk=False).get_opcodes():
        if op == "equal" or (op == "replace" and i2 - i1 == j2 - j1):
            pairs += list(zip(range(i1, i2), range(j1, j2), strict=True))
        else:
            extra += range(j1, j2)
    return pairs, extra
