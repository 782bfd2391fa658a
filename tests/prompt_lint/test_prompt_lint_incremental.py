"""Incremental piece reuse equals cutting from scratch (reference: the direct functions)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prompt_lint.detectors import PatternScanner, lines_with_ends
from prompt_lint.incremental import PieceMemo, common_prefix, common_suffix
from prompt_lint.tokens import LONG_TEXT, TokenCounter, chunks

_PIECE = st.sampled_from(["Current time: 2026-11-29T14:03:07Z", "user_id: u_1", "rule a", "b",
                          " indented", "", "x" * 700, "nonce=9fK2pQ7xLm3Nv8Rt5Wy1Zb4Hc"])
_TEXT = st.lists(_PIECE, min_size=1, max_size=12).map("\n".join)


def _naive_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="ab\n", max_size=1200), st.text(alphabet="ab\n", max_size=1200))
def test_common_prefix_and_suffix(a: str, b: str) -> None:
    assert common_prefix(a, b) == _naive_prefix(a, b)
    assert common_suffix(a, b, 10**9) == _naive_prefix(a[::-1], b[::-1])


@settings(max_examples=80, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=6))
def test_memo_matches_fresh_cut(texts: list[str]) -> None:
    for cut in (chunks, lines_with_ends):
        memo: PieceMemo[int] = PieceMemo(cut, len)
        for text in texts:
            found = memo.get(text, ("slot",))
            assert found.pieces == cut(text)
            assert found.values == [len(p) for p in found.pieces]
            assert found.starts[-1] == len(text)


@settings(max_examples=40, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=4))
def test_incremental_counts_and_spans_equal_direct(texts: list[str]) -> None:
    counter, scanner = TokenCounter(), PatternScanner()
    for text in texts:
        text = text + "\n" + "y" * LONG_TEXT  # long enough for the incremental path
        assert counter.count_at(text, "system") == counter.count(text)
        ends = [0, len(text) // 3, len(text)]
        assert counter.count_prefixes_at(text, "system", ends) == \
            counter.count_prefixes(text, ends)
        assert scanner.scan_at(text, "system") == scanner.scan(text)


def test_a_text_seen_again_keeps_its_slots_recent_and_its_weight() -> None:
    """The same text again answers the pieces the memo holds, cutting and weighing nothing
    again (the memo's weight stays), and every slot that holds them becomes the most recently
    used (LRU order: least recent first), so a text each request repeats is dropped last."""
    values: list[str] = []
    memo: PieceMemo[int] = PieceMemo(chunks, lambda p: values.append(p) or len(p))
    text = "\n".join(f"line {i}" for i in range(40))
    slots = (("system", "tail"), ("system", "head"))
    first = memo.get(text, slots)
    memo.get(text.replace("line", "item"), (("other", "tail"),))
    weight, cut = memo.slots.weight, len(values)
    assert memo.get(text, slots) is first
    assert (memo.slots.weight, len(values)) == (weight, cut)
    assert list(memo.slots) == [("other", "tail"), *slots]
