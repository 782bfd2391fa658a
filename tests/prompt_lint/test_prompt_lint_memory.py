"""Every prompt_lint cache that can hold prompt-sized data is bounded by bytes (issue 17 item 6).

For each cache: insert many large distinct items, then check that the accounted bytes stay
within the budget, equal a naive sum over what is held (the naive estimate computed here,
independently, from the held keys and values), and that what is held really is about that big
(a deep `sys.getsizeof` walk)."""

from __future__ import annotations

import random
import sys
from array import array
from collections.abc import Callable
from typing import Any

import pytest

from prompt_lint.budgets import MemoBudgets
from prompt_lint.detectors import PatternScanner
from prompt_lint.incremental import PieceMemo
from prompt_lint.memo import LRU
from prompt_lint.providers import Segment
from prompt_lint.session import SessionTracker
from prompt_lint.templates import LearnerConfig, TemplateLearner
from prompt_lint.tokens import TokenCounter, chunks

KB = 1 << 10
BUDGET = 256 * KB


def deep_size(value: object, seen: set[int] | None = None) -> int:
    """Bytes `value` holds, counting each object once (containers, NamedTuples, slots)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, str | bytes | int | float | array):
        return size
    if isinstance(value, dict):
        return size + sum(deep_size(k, seen) + deep_size(v, seen) for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return size + sum(deep_size(item, seen) for item in value)
    slots = getattr(type(value), "__slots__", ())
    return size + sum(deep_size(getattr(value, name, None), seen) for name in slots)


def _texts(n: int, seed: int, lines: int = 60) -> list[str]:
    """`n` distinct multi-line texts of ~8 kB each (values and words that differ)."""
    rng = random.Random(seed)
    return [f"doc {i} id 2026-01-{1 + i % 28:02d}T10:00:00Z\n" + "\n".join(
        " ".join(f"w{rng.randrange(50_000)}" for _ in range(16)) for _ in range(lines))
        for i in range(n)]


def _check(memo: LRU[Any, Any], naive: Callable[[Any, Any], int], slack: float = 1.0) -> None:
    """The memo's accounting against the naive estimate and the deep size of what it holds."""
    held = memo.items()
    assert held, "the memo holds nothing: the check would be empty"
    assert memo.weight <= memo.max_weight
    assert memo.weight == sum(naive(k, v) for k, v in held)
    seen: set[int] = set()
    real = sum(deep_size(k, seen) + deep_size(v, seen) for k, v in held)  # keys and values
    assert real <= memo.max_weight * slack, (real, memo.max_weight)


def _budgets() -> MemoBudgets:
    return MemoBudgets(**{f: BUDGET for f in MemoBudgets.__dataclass_fields__})


def test_token_counter_caches_hold_at_most_their_budgets() -> None:
    counter = TokenCounter(budgets=_budgets())
    for i, text in enumerate(_texts(120, 1)):
        assert counter.encode(text) == list(counter.encode_cached(text))
        assert counter.count(text) == len(counter.encode(text))
        counter.count_at(text + "\n" * (i % 2), "system")  # the incremental (pieces) path
    ids_size = sys.getsizeof  # an int32 array knows its size
    memos = counter.memos()
    _check(memos["token_chunks"], lambda k, v: sys.getsizeof(k) + ids_size(v))
    _check(memos["token_texts"], lambda k, v: sys.getsizeof(k) + ids_size(v))
    _check(memos["token_counts"], lambda k, v: sys.getsizeof(k) + 32)
    assert memos["token_pieces"].weight <= BUDGET


def test_token_counter_counts_are_exact_after_eviction() -> None:
    counter = TokenCounter(budgets=_budgets())
    reference = TokenCounter(max_chunks=1 << 20)  # default budgets: nothing evicted here
    texts = _texts(80, 2)
    for text in texts + texts[:5]:
        assert counter.encode(text) == reference.encode(text)
        assert counter.count_at(text, "s") == reference.count(text)


def test_piece_memo_is_bounded_by_bytes_and_stays_exact() -> None:
    memo: PieceMemo[int] = PieceMemo(chunks, len, max_bytes=BUDGET)
    for i, text in enumerate(_texts(100, 3)):
        found = memo.get(text, (f"slot{i}",))
        assert "".join(found.pieces) == text and found.values == list(map(len, found.pieces))
    naive = lambda k, v: sys.getsizeof(k) + memo.pieces_bytes(v)  # noqa: E731
    _check(memo.slots, naive, slack=1.0)
    assert len(memo.slots) < 100  # the byte budget, not the 1024 slots, bounded it


def test_pattern_scanner_caches_hold_at_most_their_budgets() -> None:
    scanner = PatternScanner(budgets=_budgets())
    reference = PatternScanner()
    for i, text in enumerate(_texts(120, 4)):
        assert scanner.scan(text) == reference.scan(text)
        assert scanner.scan_at(text, f"s{i % 3}") == reference.scan(text)
    memos = scanner.memos()
    for name in ("pattern_lines", "pattern_texts"):
        _check(memos[name], lambda k, v: sys.getsizeof(k) + (
            56 + sum(200 + len(s.value) for s in v) if v else 56), slack=1.0)
    assert memos["pattern_pieces"].weight <= BUDGET


def test_learner_stores_hold_at_most_their_budgets() -> None:
    config = LearnerConfig(family_bytes=BUDGET, memo_bytes=BUDGET, session_bytes=BUDGET)
    learner = TemplateLearner(config=config)
    for i, text in enumerate(_texts(150, 5)):
        learner.observe([Segment("messages[0].content", text, True, 0)], {}, [],
                        session=f"s{i % 7}")
    stores = learner.memos()
    assert len(learner.families) < 150  # families were dropped for bytes, not for count
    assert stores["families"].weight <= config.family_bytes
    assert stores["families"].weight == sum(f.held_bytes for f in learner.families.values())
    seen: set[int] = set()
    assert sum(deep_size(f, seen) for f in learner.families.values()) <= config.family_bytes
    live = set(learner.families)
    for index in (learner.index.lines, learner.index.pairs):  # no dangling index
        assert all(owners <= live for owners in index.values())
    for name in ("masks", "sets", "recent"):
        assert stores[name].weight <= stores[name].max_weight, name
    assert sum(stores[n].max_weight for n in ("masks", "sets", "recent")) <= config.memo_bytes


def test_session_tracker_is_bounded_by_bytes() -> None:
    tracker = SessionTracker(max_bytes=BUDGET)
    rng = random.Random(6)
    for i in range(400):
        history = [f"{rng.getrandbits(96):024x}" for _ in range(200)]
        tracker.compare_and_record(f"session-{i}", history, list(range(200)))
        tracker.remember(f"msg-{i}", {"role": "user", "content": "x" * 2000})
    stores = tracker.memos()
    _check(stores["session_histories"],
           lambda k, v: sys.getsizeof(k) + 112 + 121 * len(v.history), slack=1.0)
    _check(stores["session_rewrites"],
           lambda k, v: sys.getsizeof(k) + sys.getsizeof(v) + sum(
               sys.getsizeof(a) + sys.getsizeof(b) for a, b in v.items()), slack=1.0)
    assert len(tracker) < 400


@pytest.mark.parametrize("nest", ["message", "tool_result", "document"])
def test_session_tracker_weighs_images_however_deep(nest: str) -> None:
    """A remembered message holding a screenshot (in the message, inside a tool_result, in a
    document's content) is weighed with it: the store's real size (deep_size, the reference)
    stays within its budget (a tool_result's image was weighed as ~1 kB, so the store held
    megabytes past it)."""
    tracker = SessionTracker(max_bytes=BUDGET)
    for i in range(50):
        image: dict[str, Any] = {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": f"{i:04d}" + "A" * 64 * KB}}
        block = {"message": image,
                 "tool_result": {"type": "tool_result", "tool_use_id": "t", "content": [image]},
                 "document": {"type": "document", "source": {
                     "type": "content", "content": [image]}}}[nest]
        tracker.remember(f"msg-{i}", {"role": "user", "content": [block]})
    rewrites = tracker.memos()["session_rewrites"]
    held = rewrites.items()
    assert held and rewrites.weight <= rewrites.max_weight
    seen: set[int] = set()
    assert sum(deep_size(k, seen) + deep_size(v, seen) for k, v in held) <= rewrites.max_weight


def test_budgets_are_validated_and_add_up() -> None:
    assert MemoBudgets().total == 124 << 20
    with pytest.raises(ValueError, match="token_chunks"):
        MemoBudgets(token_chunks=0)
    with pytest.raises(ValueError, match="family_bytes"):
        LearnerConfig(family_bytes=0)
