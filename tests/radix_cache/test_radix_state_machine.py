"""Hypothesis state machine: RadixCache against a naive dict-of-prefixes model."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radix_cache import Handle, PackedTokens, RadixCache

Key = tuple[str, tuple[int, ...]]


class CollidingCache(RadixCache):
    """Every page hashes alike, so every sibling after the first goes through the overflow."""

    _hash = staticmethod(lambda page: 7)


class NaiveCache:
    """Reference: one dict entry per cached page, keyed by (namespace, tokens up to its end)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[Key, int] = {}
        self.used: dict[Key, int] = {}
        self.locks: dict[Key, int] = {}
        self.clock = 0

    def keys(self, tokens: list[int], namespace: str) -> list[Key]:
        full = len(tokens) // self.page_size
        return [(namespace, tuple(tokens[: (i + 1) * self.page_size])) for i in range(full)]

    def match(self, tokens: list[int], namespace: str) -> tuple[int, list[int], Key | None]:
        self.clock += 1
        hit: list[Key] = []
        for key in self.keys(tokens, namespace):
            if key not in self.pages:
                break
            hit.append(key)
            self.used[key] = self.clock
        return len(hit) * self.page_size, [self.pages[k] for k in hit], hit[-1] if hit else None

    def insert(
        self, tokens: list[int], pages: list[int], namespace: str
    ) -> tuple[int, list[int], Key | None]:
        self.clock += 1
        cached, duplicates = 0, []
        keys = self.keys(tokens, namespace)
        for key, page in zip(keys, pages, strict=True):
            if key in self.pages:
                cached += self.page_size
                if self.pages[key] != page:
                    duplicates.append(page)
            else:
                self.pages[key] = page
            self.used[key] = self.clock
        return cached, duplicates, keys[-1] if keys else None

    def lock(self, key: Key | None, delta: int) -> None:
        if key is None:
            return
        namespace, tokens = key
        for end in range(len(tokens), 0, -self.page_size):
            prefix = (namespace, tokens[:end])
            self.locks[prefix] = self.locks.get(prefix, 0) + delta

    def evict(self, count: int) -> list[int]:
        freed = []
        while len(freed) < count:
            parents = {(ns, toks[: -self.page_size]) for ns, toks in self.pages}
            leaves = [k for k in self.pages if k not in parents and not self.locks.get(k)]
            if not leaves:
                break
            victim = min(leaves, key=lambda k: self.used[k])
            freed.append(self.pages.pop(victim))
            del self.used[victim]
        return freed

    def truncate(self, tokens: list[int], length: int, namespace: str) -> list[int]:
        """Drop the page after `length` (rounded down) and every entry extending it, unless
        any of them is locked or the path to it is not cached."""
        keep, size = length // self.page_size, self.page_size
        if keep >= len(tokens) // size or not any(k[0] == namespace for k in self.pages):
            return []
        self.match(tokens[: keep * size], namespace)  # the kept part is used: touched
        head = tuple(tokens[: (keep + 1) * size])
        if len(head) < (keep + 1) * size or (namespace, head) not in self.pages:
            return []
        doomed = [k for k in self.pages if k[0] == namespace and k[1][: len(head)] == head]
        if any(self.locks.get(k) for k in doomed):
            return []
        for key in doomed:
            del self.used[key]
        return [self.pages.pop(k) for k in doomed]

    def locked_pages(self) -> int:
        return sum(1 for key in self.pages if self.locks.get(key))


tokens_st = st.lists(st.integers(0, 2), max_size=90)


def as_input(tokens: list[int], kind: str) -> Any:
    if kind == "list":
        return tokens
    if kind == "packed":
        return PackedTokens(tokens)
    return np.asarray(tokens, dtype=np.int64 if kind == "int64" else np.int32)


class RadixMachine(RuleBasedStateMachine):
    """Random insert/match/lock/unlock/evict sequences; both sides must agree on every answer."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = RadixCache(1)
        self.model = NaiveCache(1)
        self.held: list[tuple[Handle, Key | None]] = []
        self.next_page = 0

    @initialize(page_size=st.sampled_from([1, 4, 16]), colliding=st.booleans())
    def setup(self, page_size: int, colliding: bool) -> None:
        self.cache = (CollidingCache if colliding else RadixCache)(page_size=page_size)
        self.model = NaiveCache(page_size)

    def fresh(self, count: int) -> list[int]:
        self.next_page += count
        return list(range(self.next_page - count, self.next_page))

    @rule(
        tokens=tokens_st,
        namespace=st.sampled_from(["", "b"]),
        kind=st.sampled_from(["list", "int64", "int32"]),
        reuse=st.booleans(),
        lock=st.booleans(),
    )
    def insert(self, tokens: list[int], namespace: str, kind: str, reuse: bool, lock: bool) -> None:
        full = len(tokens) // self.model.page_size
        pages = self.fresh(full)
        if reuse:  # engine style: the prefix it matched is passed back with the cache's own ids
            known = self.cache.match(tokens, namespace).pages
            self.model.match(tokens, namespace)
            pages[: len(known)] = known
        got = self.cache.insert(as_input(tokens, kind), pages, namespace)
        cached, duplicates, key = self.model.insert(tokens, pages, namespace)
        assert (got.cached_len, got.duplicate_pages) == (cached, duplicates)
        if lock:
            self.hold(got.handle, key)

    @rule(
        tokens=tokens_st,
        namespace=st.sampled_from(["", "b"]),
        kind=st.sampled_from(["list", "int64", "packed"]),
        lock=st.booleans(),
    )
    def match(self, tokens: list[int], namespace: str, kind: str, lock: bool) -> None:
        got = self.cache.match(as_input(tokens, kind), namespace)
        length, pages, key = self.model.match(tokens, namespace)
        assert (got.length, got.pages) == (length, pages)
        assert (got.handle is None) == (key is None)
        if lock:
            self.hold(got.handle, key)

    def hold(self, handle: Handle, key: Key | None) -> None:
        self.cache.lock(handle)
        self.model.lock(key, +1)
        self.held.append((handle, key))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def unlock(self, index: int) -> None:
        handle, key = self.held.pop(index % len(self.held))
        self.cache.unlock(handle)
        self.model.lock(key, -1)

    @rule(tokens=tokens_st, length=st.integers(0, 90), namespace=st.sampled_from(["", "b"]),
          kind=st.sampled_from(["list", "packed"]))
    def truncate(self, tokens: list[int], length: int, namespace: str, kind: str) -> None:
        got = self.cache.truncate(as_input(tokens, kind), length, namespace)
        assert sorted(got) == sorted(self.model.truncate(tokens, length, namespace))

    @rule(count=st.integers(0, 12))
    def evict(self, count: int) -> None:
        assert self.cache.evict(count) == self.model.evict(count)

    @invariant()
    def consistent(self) -> None:
        self.cache.check()
        stats = self.cache.stats
        assert stats.total_pages == len(self.model.pages)
        assert stats.locked_pages == self.model.locked_pages()
        assert stats.evictable_pages == stats.total_pages - stats.locked_pages


RadixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixStateMachine = RadixMachine.TestCase
