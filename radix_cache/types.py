"""Named result types returned by :class:`radix_cache.RadixCache`."""

from __future__ import annotations

from typing import NamedTuple

from radix_cache.node import Node

Handle = Node | None
"""Opaque reference to the deepest node of a match or insert; ``None`` when nothing matched.

Pass it to ``RadixCache.lock`` / ``RadixCache.unlock``; both accept ``None`` as a no-op.
"""


class MatchResult(NamedTuple):
    """Outcome of ``RadixCache.match``.

    ``length`` is the number of leading tokens already cached (a multiple of ``page_size``),
    ``pages`` the page ids that cover ``tokens[:length]`` in order, and ``handle`` the deepest
    matched node (``None`` when ``length == 0``).
    """

    length: int
    pages: list[int]
    handle: Handle


class InsertResult(NamedTuple):
    """Outcome of ``RadixCache.insert``.

    ``cached_len`` is how many leading tokens were already cached before this call.
    ``duplicate_pages`` are the caller's page ids for positions that were already cached under
    a *different* page id: the cache keeps its own copy, so the caller may free these.
    ``handle`` is the node covering the last full page of ``tokens`` (``None`` if no full page).
    """

    cached_len: int
    duplicate_pages: list[int]
    handle: Handle


class CacheStats(NamedTuple):
    """Counters of a :class:`radix_cache.RadixCache`.

    ``queries``/``query_tokens``/``hit_tokens`` count ``match`` calls, the tokens they asked
    about and the tokens found cached. ``total_pages`` = ``evictable_pages`` + ``locked_pages``.
    """

    queries: int
    query_tokens: int
    hit_tokens: int
    total_pages: int
    evictable_pages: int
    locked_pages: int
