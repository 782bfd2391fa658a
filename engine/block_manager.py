"""`BlockManager`: owns the KV page pool and the radix prefix cache.

Every page is always in exactly one of three places: the free list, the radix cache (possibly
locked by running sequences), or a running sequence's private pages. `check()` verifies it.

Life of a sequence's pages:
- admit: `match` the tokens (all but the last, so at least one token is recomputed and its
  logits exist) against the cache, lock the match and use its pages as the sequence's first
  pages; `allocate` grows the page list as tokens are scheduled, evicting least recently used
  unlocked cache pages when the free list runs short.
- after every step, `cache_computed` inserts the pages the step filled, so concurrent requests
  with a shared prefix reuse each other's pages as soon as they exist;
- release (finish, abort, preemption): the same insertion, then the remaining private pages
  (the partial last page) are freed and the match is unlocked.
- speculative decoding: a draft's pages are allocated without eviction; after verification
  `rollback` frees the pages only rejected draft tokens reached. Rejected tokens' KV slots lie
  past `num_computed_tokens`, so `cache_computed` never inserts them into the radix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence
from radix_cache import RadixCache


@dataclass(slots=True)
class PrefixCacheCounters:
    """Prefix-cache lookups of admitted requests."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


class BlockManager:
    """Allocates KV pages to sequences and shares full pages through a `RadixCache`."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.cache: RadixCache | None = RadixCache(page_size) if enable_prefix_caching else None
        self._free: deque[int] = deque(range(num_pages))
        self._cache_pages: set[int] = set()
        self.counters = PrefixCacheCounters()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        """Pages owned by the radix cache (some may be locked by running sequences)."""
        return len(self._cache_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------ admission
    def match(self, seq: Sequence) -> None:
        """Give a fresh (page-less) sequence the cached pages of its longest cached prefix."""
        assert not seq.pages and seq.num_computed_tokens == 0, "match of a sequence with pages"
        if self.cache is None:
            return
        result = self.cache.match(seq.token_ids[:-1], namespace=seq.namespace)
        self.cache.lock(result.handle)
        seq.pages = list(result.pages)
        seq.num_cached_pages = len(result.pages)
        seq.cache_handle = result.handle
        seq.num_computed_tokens = result.length

    def count_admission(self, seq: Sequence) -> None:
        """Record the admitted sequence's lookup (prompt tokens asked, tokens reused)."""
        self.counters.queries += 1
        self.counters.query_tokens += seq.num_tokens
        self.counters.hit_tokens += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int, *, evict: bool = True) -> bool:
        """Ensure `seq` has pages for its first `num_tokens` tokens; False if the pool is short.

        Evicts unlocked cache pages (least recently used first) before giving up, unless
        evict=False (speculative drafts use free pages only).
        """
        needed = self.pages_for(num_tokens) - len(seq.pages)
        if needed <= 0:
            return True
        if needed > len(self._free):
            if not evict:
                return False
            self._evict(needed - len(self._free))
            if needed > len(self._free):
                return False
        seq.pages.extend(self._free.popleft() for _ in range(needed))
        return True

    # ------------------------------------------------------------------ caching
    def cache_computed(self, seq: Sequence) -> None:
        """Hand `seq`'s computed full pages to the cache now (after every step), so requests
        admitted later share them even while `seq` still runs.

        Positions the cache already held under other page ids (computed concurrently by another
        request) switch to the cache's pages and the duplicates are freed; `seq` then locks
        the deeper node and unlocks the old one.
        """
        n_full = min(seq.num_computed_tokens // self.page_size, len(seq.pages))
        if self.cache is None or n_full <= seq.num_cached_pages:
            return
        tokens = seq.token_ids[: n_full * self.page_size]
        self.cache.insert(tokens, seq.pages[:n_full], namespace=seq.namespace)
        match = self.cache.match(tokens, namespace=seq.namespace)
        assert match.length == len(tokens), "inserted pages must match in full"
        mine = seq.pages[seq.num_cached_pages : n_full]
        kept = set(match.pages)
        self._cache_pages.update(p for p in mine if p in kept)
        self._free.extend(p for p in mine if p not in kept)
        self.cache.lock(match.handle)
        self.cache.unlock(seq.cache_handle)  # type: ignore[arg-type]
        seq.pages[:n_full] = match.pages
        seq.num_cached_pages = n_full
        seq.cache_handle = match.handle

    def rollback(self, seq: Sequence) -> None:
        """Free `seq`'s pages past its tokens (pages only rejected draft tokens reached).

        Their slots held KV of rejected tokens; the page of the next token is kept.
        """
        keep = max(self.pages_for(seq.num_tokens), seq.num_cached_pages)
        extra = seq.pages[keep:]
        if extra:
            self._free.extend(extra)
            del seq.pages[keep:]

    # ------------------------------------------------------------------ release
    def release(self, seq: Sequence, *, keep_computed: bool = True) -> None:
        """Take back all of `seq`'s pages; computed full pages go to the cache if enabled.

        keep_computed=False (after a failed step, whose KV may be garbage) frees the private
        pages without caching them.
        """
        if keep_computed:
            self.cache_computed(seq)
        self._free.extend(seq.pages[seq.num_cached_pages :])
        if self.cache is not None:
            self.cache.unlock(seq.cache_handle)  # type: ignore[arg-type]
        seq.pages = []
        seq.num_cached_pages = 0
        seq.cache_handle = None
        seq.num_computed_tokens = 0

    def _evict(self, num_pages: int) -> None:
        if self.cache is None:
            return
        freed = self.cache.evict(num_pages)
        self._cache_pages.difference_update(freed)
        self._free.extend(freed)

    # ------------------------------------------------------------------ accounting
    def check(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError unless every page is free, cached, or private to one sequence."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a page is on the free list twice"
        owners: dict[int, str] = {p: "free" for p in free}
        for p in self._cache_pages:
            assert p not in owners, f"page {p} is both {owners[p]} and cached"
            owners[p] = "cache"
        for seq in live:
            for p in seq.pages[: seq.num_cached_pages]:
                assert owners.get(p) == "cache", f"{seq.request_id} locks page {p} not cached"
            for p in seq.pages[seq.num_cached_pages :]:
                assert p not in owners, f"page {p} of {seq.request_id} is also {owners[p]}"
                owners[p] = seq.request_id
        assert len(owners) == self.num_pages, (
            f"{self.num_pages - len(owners)} pages are lost (neither free, cached nor in use)"
        )
        if self.cache is not None:
            self.cache.check()
            assert self.cache.stats.total_pages == len(self._cache_pages), (
                f"cache holds {self.cache.stats.total_pages} pages, manager thinks "
                f"{len(self._cache_pages)}"
            )
