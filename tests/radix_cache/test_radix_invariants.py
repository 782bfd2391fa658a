"""Invariant tests of RadixCache with page sizes 1, 4 and 16, each checked against plain lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from radix_cache import CacheStats, RadixCache, pack_tokens
from radix_cache.tokens import PackMemo

PAGE_SIZES = [1, 4, 16]


def seq(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(length)]


def ids(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


@pytest.fixture(params=PAGE_SIZES, ids=lambda p: f"page{p}")
def cache(request: pytest.FixtureRequest) -> RadixCache:
    return RadixCache(page_size=request.param)


def test_match_is_page_aligned_and_pages_cover_prefix(cache: RadixCache) -> None:
    ps = cache.page_size
    tokens = seq(1, 7 * ps + ps // 2)
    pages = ids(100, 7)
    cache.insert(tokens, pages)
    for cut in range(0, len(tokens) + 3 * ps, max(1, ps // 3)):
        query = tokens[:cut] + seq(2, 3 * ps)[: max(0, cut - len(tokens))]
        got = cache.match(query)
        full = min(cut, len(tokens)) // ps
        assert got.length == full * ps
        assert got.pages == pages[:full]
    cache.check()


def test_divergent_suffix_matches_only_shared_whole_pages(cache: RadixCache) -> None:
    ps = cache.page_size
    base = seq(3, 6 * ps)
    cache.insert(base, ids(0, 6))
    for diverge in range(6 * ps):
        query = base[:diverge] + [60_000] + base[diverge + 1 :]
        got = cache.match(np.asarray(query, dtype=np.int64))
        assert got.length == (diverge // ps) * ps
        assert got.pages == list(range(diverge // ps))
        cache.check()


def test_namespaces_never_share(cache: RadixCache) -> None:
    ps = cache.page_size
    tokens = seq(4, 5 * ps)
    first = cache.insert(tokens, ids(0, 5), namespace="tenant-a")
    assert cache.match(tokens, namespace="tenant-b").length == 0
    assert cache.match(tokens).length == 0
    second = cache.insert(tokens, ids(10, 5), namespace="tenant-b")
    assert second.cached_len == 0 and second.duplicate_pages == []
    assert cache.match(tokens, namespace="tenant-a").pages == ids(0, 5)
    assert cache.match(tokens, namespace="tenant-b").pages == ids(10, 5)
    assert first.handle is not second.handle
    cache.lock(second.handle)
    assert sorted(cache.evict(100)) == ids(0, 5)
    assert cache.match(tokens, namespace="tenant-b").pages == ids(10, 5)
    cache.check()


def test_duplicate_pages_are_the_callers_redundant_ids(cache: RadixCache) -> None:
    ps = cache.page_size
    shared = seq(5, 4 * ps)
    cache.insert(shared, ids(0, 4))
    longer = shared + seq(6, 3 * ps)
    # engine style: passes back the cached ids it matched, so nothing is a duplicate
    own = cache.insert(longer, ids(0, 4) + ids(50, 3))
    assert (own.cached_len, own.duplicate_pages) == (4 * ps, [])
    # computed independently: every cached position with a different id is a duplicate
    again = longer + seq(7, 2 * ps)
    other = cache.insert(again, [0, 91, 2, 93, 50, 95, 96, 97, 98])
    assert other.cached_len == 7 * ps
    assert other.duplicate_pages == [91, 93, 95, 96]
    assert cache.match(again).pages == ids(0, 4) + ids(50, 3) + [97, 98]
    cache.check()


def test_lock_pins_node_and_ancestors(cache: RadixCache) -> None:
    ps = cache.page_size
    trunk = seq(8, 3 * ps)
    branch_a = trunk + seq(9, 2 * ps)
    branch_b = trunk + seq(10, 2 * ps)
    cache.insert(branch_a, ids(0, 5))
    held = cache.insert(branch_b, ids(0, 3) + ids(20, 2))
    cache.lock(held.handle)
    assert cache.stats.locked_pages == 5 and cache.evictable_pages == 2
    assert sorted(cache.evict(100)) == [3, 4]
    assert cache.match(branch_b).pages == ids(0, 3) + ids(20, 2)
    assert cache.evict(100) == []
    cache.unlock(held.handle)
    assert sorted(cache.evict(100)) == ids(0, 3) + ids(20, 2)
    assert cache.stats.total_pages == 0
    cache.check()


def test_lock_survives_a_split_of_the_locked_node(cache: RadixCache) -> None:
    ps = cache.page_size
    tokens = seq(11, 6 * ps)
    held = cache.insert(tokens, ids(0, 6))
    cache.lock(held.handle)
    cache.insert(tokens[: 2 * ps] + seq(12, 2 * ps), ids(0, 2) + ids(30, 2))  # splits it
    cache.check()
    assert sorted(cache.evict(100)) == [30, 31]
    cache.unlock(held.handle)
    cache.check()
    assert len(cache.evict(100)) == 6


def test_evict_returns_fewer_only_when_nothing_else_is_evictable(cache: RadixCache) -> None:
    ps = cache.page_size
    handles = []
    for i in range(6):
        handles.append(cache.insert(seq(20 + i, (i + 1) * ps), ids(10 * i, i + 1)).handle)
    cache.lock(handles[2])
    cache.lock(handles[4])
    total = sum(range(1, 7))
    assert cache.evictable_pages == total - 3 - 5
    freed = cache.evict(4)
    assert len(freed) == 4
    freed += cache.evict(1000)
    assert len(freed) == total - 8
    assert cache.stats == CacheStats(0, 0, 0, 8, 0, 8)
    cache.check()


def test_lru_order_and_tail_first(cache: RadixCache) -> None:
    ps = cache.page_size
    seqs = [seq(30 + i, 3 * ps) for i in range(3)]
    for i, tokens in enumerate(seqs):
        cache.insert(tokens, ids(10 * i, 3))
    cache.match(seqs[0])  # 0 becomes the most recent, 1 the least
    assert cache.evict(2) == [12, 11]
    assert cache.evict(3) == [10, 22, 21]
    cache.match(seqs[0][: 2 * ps])  # refreshes 0's remaining pages
    assert cache.evict(10) == [20, 2, 1, 0]  # page 2 was not refreshed
    cache.check()


def test_parent_becomes_evictable_after_its_children(cache: RadixCache) -> None:
    ps = cache.page_size
    trunk = seq(40, 2 * ps)
    cache.insert(trunk + seq(41, ps), ids(0, 3))
    cache.insert(trunk + seq(42, ps), [0, 1, 5])
    cache.insert(seq(43, ps), [9])  # newest
    assert cache.evict(4) == [2, 5, 1, 0]
    assert cache.match(seq(43, ps)).pages == [9]
    cache.check()


def test_shadow_mode_assigns_distinct_ids(cache: RadixCache) -> None:
    ps = cache.page_size
    a, b = seq(50, 4 * ps), seq(51, 3 * ps)
    first = cache.insert(a, None)
    second = cache.insert(a[: 2 * ps] + b, None)
    assert first.cached_len == 0 and second.cached_len == 2 * ps
    assert second.duplicate_pages == []
    pages_a, pages_b = cache.match(a).pages, cache.match(a[: 2 * ps] + b).pages
    assert len(set(pages_a) | set(pages_b)) == 7
    assert pages_a[:2] == pages_b[:2]
    cache.check()


def test_stats_count_queries_and_hits(cache: RadixCache) -> None:
    ps = cache.page_size
    tokens = seq(60, 4 * ps)
    cache.insert(tokens, ids(0, 4))
    cache.match(tokens + [1] * ps)
    cache.match(seq(61, 3))
    stats = cache.stats
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (2, 5 * ps + 3, 4 * ps)


def test_empty_match_handle_is_safe_to_lock() -> None:
    cache = RadixCache(page_size=4)
    miss = cache.match([1, 2, 3, 4, 5])
    assert miss.handle is None and miss.length == 0 and miss.pages == []
    cache.lock(miss.handle)
    cache.unlock(miss.handle)
    assert cache.insert([1, 2, 3], []).handle is None
    cache.check()


def test_bad_input_gets_clear_errors() -> None:
    cache = RadixCache(page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match="one page id per full page"):
        cache.insert(list(range(8)), [1])
    with pytest.raises(ValueError, match="int32"):
        cache.insert([2**40] * 4, [1])
    with pytest.raises(ValueError, match="int32"):
        cache.match(np.full(4, 2**40, dtype=np.int64))
    with pytest.raises(ValueError, match="integer dtype"):
        cache.match(np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match="one-dimensional"):
        cache.match(np.zeros((2, 4), dtype=np.int32))
    with pytest.raises(TypeError, match="namespace"):
        cache.match([1, 2, 3, 4], namespace=None)  # type: ignore[arg-type]
    held = cache.insert(list(range(4)), [1]).handle
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(held)
    cache.evict(1)
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(held)
    with pytest.raises(ValueError, match="num_pages"):
        cache.evict(-1)


def test_lru_heap_stays_bounded_without_eviction() -> None:
    cache = RadixCache(page_size=4)
    tokens = seq(70, 12)
    cache.insert(tokens, ids(0, 3))
    for _ in range(1000):
        cache.match(tokens)
    assert len(cache._leaves) <= 2 * 1 + 64  # stale LRU entries are compacted away
    assert cache.evict(5) == [2, 1, 0]


def test_pack_memo_matches_plain_packing_even_after_mutation() -> None:
    memo = PackMemo()
    rng = random.Random(80)
    tokens = [rng.randrange(1000) for _ in range(64)]
    cases = [
        tokens,
        tokens + [5, 6, 7],  # extends the previous list
        tokens[:40],  # a prefix of it
        tokens[:40] + [9] * 30,  # diverges after position 40
    ]
    for case in cases:
        for count in (0, 16, len(case) // 2, len(case)):
            assert memo.pack(case, count) == pack_tokens(case, count)
    grown = tokens + [1, 2, 3]
    memo.pack(grown, len(grown))
    grown[10] = 999  # mutated in place: the memo must notice
    assert memo.pack(grown, len(grown)) == pack_tokens(np.asarray(grown), len(grown))


def test_match_after_in_place_mutation_of_the_token_list() -> None:
    cache = RadixCache(page_size=4)
    tokens = list(range(16))
    cache.insert(tokens, ids(0, 4))
    assert cache.match(tokens).length == 16
    tokens[5] = 100
    assert cache.match(tokens).pages == [0]
    cache.check()
