"""The page-aligned radix tree over token ids shared by the engine and the gateway."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from radix_cache.invariants import check_tree
from radix_cache.lru import LeafHeap, is_evictable_leaf
from radix_cache.node import Node
from radix_cache.tokens import TOKEN_BYTES, PackMemo, TokenInput
from radix_cache.types import CacheStats, Handle, InsertResult, MatchResult

PageIds = Sequence[int]


class RadixCache:
    """Prefix cache of whole pages of token ids, one tree per namespace.

    Contract:
    - ``match`` reads only (it refreshes LRU times and may split a node at a page boundary,
      which changes no answer). Its handle is valid until the next ``evict``: lock it first.
    - ``insert`` stores the full pages of ``tokens`` not yet cached; the cache then owns the
      caller's page ids for the new pages. With ``pages=None`` (shadow mode) the cache assigns
      its own ids; do not mix shadow and caller ids in one cache.
    - ``lock``/``unlock`` pin a node and all its ancestors with a reference count; a pinned page
      is never evicted. Both accept ``None`` (the handle of an empty match) as a no-op.
    - ``evict(n)`` frees up to ``n`` pages from least recently used unlocked leaves (the tail
      of a leaf first) and returns their ids; fewer only when nothing else is evictable.
    - Tokens are packed to int32 bytes once per call (numpy input is cheapest); a token list
      that extends the previous call's list (match prompt, then insert prompt + reply) packs
      only its new tail.
    """

    _hash: Callable[[bytes], int] = staticmethod(xxhash.xxh3_64_intdigest)

    def __init__(self, page_size: int = 16) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._roots: dict[str, Node] = {}
        self._root_names: dict[int, str] = {}
        self._leaves = LeafHeap()
        self._clock = 0
        self._nodes = 0
        self._total_pages = 0
        self._locked_pages = 0
        self._queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._next_shadow_page = 0
        self._packer = PackMemo()

    # ----------------------------------------------------------------- public API
    def match(self, tokens: TokenInput, namespace: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` in ``namespace``."""
        n_pages = len(tokens) // self.page_size
        self._queries += 1
        self._query_tokens += len(tokens)
        buf = self._packer.pack(tokens, n_pages * self.page_size)
        root = self._roots.get(_check_namespace(namespace))
        if root is None or n_pages == 0:
            return MatchResult(0, [], None)
        node, offset, pages = self._walk(root, buf)
        self._touched(node)
        length = offset // TOKEN_BYTES
        self._hit_tokens += length
        return MatchResult(length, pages, None if node is root else node)

    def insert(
        self, tokens: TokenInput, pages: PageIds | None, namespace: str = ""
    ) -> InsertResult:
        """Cache the full pages of ``tokens``; ``pages`` has one id per full page (or None)."""
        n_pages = len(tokens) // self.page_size
        if pages is not None and len(pages) != n_pages:
            raise ValueError(
                f"need one page id per full page: {len(tokens)} tokens make {n_pages} pages "
                f"of {self.page_size}, got {len(pages)} page ids"
            )
        _check_namespace(namespace)
        if n_pages == 0:
            return InsertResult(0, [], None)
        buf = self._packer.pack(tokens, n_pages * self.page_size)
        root = self._root(namespace)
        node, offset, cached = self._walk(root, buf)
        hit = len(cached)
        duplicates = [] if pages is None else _changed(pages, cached)
        if hit < n_pages:
            fresh = self._shadow_ids(n_pages - hit) if pages is None else _as_ids(pages, hit)
            node = self._add_child(node, buf[offset:], fresh)
        self._touched(node)
        return InsertResult(hit * self.page_size, duplicates, None if node is root else node)

    def truncate(self, tokens: TokenInput, length: int, namespace: str = "") -> list[int]:
        """Drop what is cached of ``tokens`` past its first ``length`` tokens (rounded down to
        a page), with every entry that extends that part; return the freed page ids.

        For a shadow cache told that its upstream kept less of a prompt than predicted. Locked
        pages are never dropped: nothing is freed when the part to drop is locked.
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be a non-negative int, got {length!r}")
        n_pages, keep = len(tokens) // self.page_size, length // self.page_size
        root = self._roots.get(_check_namespace(namespace))
        if root is None or keep >= n_pages:
            return []
        buf = self._packer.pack(tokens, n_pages * self.page_size)
        cut = keep * self._page_bytes
        node, offset, _ = self._walk(root, buf[:cut])
        self._touched(node)  # the walk refreshed its time: a leaf needs a fresh heap entry
        child = self._child(node, buf[cut : cut + self._page_bytes]) if offset == cut else None
        if child is None or child.lock_ref:
            return []
        freed = self._drop_subtree(child)
        self._remove(child)
        return freed

    def lock(self, handle: Handle) -> None:
        """Pin ``handle``'s node and its ancestors against eviction (reference counted)."""
        if handle is None:
            return
        if handle.detached or handle.parent is None:
            raise ValueError("cannot lock a handle whose node was evicted; lock right after match")
        handle.pins += 1
        node: Node | None = handle
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: Handle) -> None:
        """Release one ``lock`` of ``handle``; its pages become evictable when unpinned."""
        if handle is None:
            return
        if handle.pins <= 0:
            raise ValueError("unlock of a handle that is not locked")
        handle.pins -= 1
        node: Node | None = handle
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
                if node.is_leaf():
                    self._push_leaf(node)
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Free up to ``num_pages`` least recently used unlocked pages; return their ids."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        freed: list[int] = []
        while len(freed) < num_pages:
            node = self._leaves.peek()
            if node is None:
                break
            self._evict_from(node, num_pages - len(freed), freed)
        self._total_pages -= len(freed)
        return freed

    @property
    def evictable_pages(self) -> int:
        """Pages ``evict`` could free now (all pages not pinned by a lock)."""
        return self._total_pages - self._locked_pages

    @property
    def stats(self) -> CacheStats:
        """Query counters and page counts."""
        return CacheStats(
            self._queries,
            self._query_tokens,
            self._hit_tokens,
            self._total_pages,
            self.evictable_pages,
            self._locked_pages,
        )

    def check(self) -> None:
        """Raise AssertionError if any invariant of the tree is broken."""
        check_tree(
            self._roots,
            self._hash,
            self._page_bytes,
            self._leaves.valid_nodes(),
            (self._nodes, self._total_pages, self._locked_pages),
        )

    # ------------------------------------------------------------------ internals
    def _walk(self, root: Node, buf: bytes) -> tuple[Node, int, list[int]]:
        """Follow ``buf`` down from ``root``; return deepest node, bytes matched, page ids."""
        self._clock += 1
        now, page_bytes, end = self._clock, self._page_bytes, len(buf)
        node, offset = root, 0
        pages: list[int] = []
        while offset < end:
            child = self._child(node, buf[offset : offset + page_bytes])
            if child is None:
                break
            if not buf.startswith(child.key, offset):
                child = self._split(child, self._common_pages(child.key, buf, offset))
                end = offset  # the query diverges right below the split: stop after this node
            child.last_access = now
            pages += child.pages
            offset += len(child.key)
            node = child
        return node, offset, pages

    def _child(self, node: Node, page: bytes) -> Node | None:
        child = node.children.get(self._hash(page))
        if child is not None and child.key.startswith(page):
            return child
        return node.overflow.get(page) if node.overflow else None

    def _common_pages(self, key: bytes, buf: bytes, offset: int) -> int:
        """Whole pages shared by ``key`` and ``buf[offset:]`` (at least one, fewer than all):
        slice compares over doubling spans, then a binary search in pages."""
        page_bytes = self._page_bytes
        limit = min(len(key), len(buf) - offset) // page_bytes
        lo, step = 1, 1  # pages known equal (the first page matched by hash and bytes)
        while lo < limit:
            hi = min(lo + step, limit)
            if not buf.startswith(key[lo * page_bytes : hi * page_bytes], offset + lo * page_bytes):
                break
            lo, step = hi, step * 2
        else:
            return lo
        while hi - lo > 1:  # pages [0, lo) equal, [0, hi) not
            mid = (lo + hi) // 2
            if buf.startswith(key[lo * page_bytes : mid * page_bytes], offset + lo * page_bytes):
                lo = mid
            else:
                hi = mid
        return lo

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut ``node`` after ``n_pages``; return the new upper part (node keeps the rest)."""
        cut = n_pages * self._page_bytes
        parent = node.parent
        assert parent is not None, "a root is never split"
        top = Node(node.key[:cut], node.pages[:n_pages], parent, node.hkey, node.last_access)
        top.lock_ref = node.lock_ref
        self._replace_child(parent, node, top)
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], top
        node.hkey = self._hash(node.key[: self._page_bytes])
        top.children[node.hkey] = node
        self._nodes += 1
        return top

    def _add_child(self, parent: Node, key: bytes, pages: Sequence[int]) -> Node:
        first = key[: self._page_bytes]
        hkey = self._hash(first)
        child = Node(key, pages, parent, hkey, self._clock)
        if hkey in parent.children:  # a different first page with the same hash
            if parent.overflow is None:
                parent.overflow = {}
            parent.overflow[first] = child
        else:
            parent.children[hkey] = child
        self._nodes += 1
        self._total_pages += len(pages)
        return child

    def _replace_child(self, parent: Node, old: Node, new: Node | None) -> None:
        if parent.children.get(old.hkey) is old:
            if new is None:
                del parent.children[old.hkey]
            else:
                parent.children[old.hkey] = new
            return
        assert parent.overflow is not None, "child missing from its parent"
        first = old.key[: self._page_bytes]
        if new is None:
            del parent.overflow[first]
        else:
            parent.overflow[first] = new

    def _evict_from(self, node: Node, wanted: int, freed: list[int]) -> None:
        """Free the last ``wanted`` pages of leaf ``node`` (all of them removes the node)."""
        keep = max(len(node.pages) - wanted, 0)
        freed.extend(reversed(node.pages[keep:]))
        if keep:
            node.pages = node.pages[:keep]
            node.key = node.key[: keep * self._page_bytes]
            return
        self._leaves.pop()
        self._remove(node)

    def _drop_subtree(self, top: Node) -> list[int]:
        """Detach every node below ``top`` (not ``top`` itself); return all their page ids and
        ``top``'s, and take them off the page count."""
        freed, stack = list(top.pages), list(_children(top))
        while stack:
            node = stack.pop()
            freed += node.pages
            node.detached = True
            self._nodes -= 1
            stack += _children(node)
        self._total_pages -= len(freed)
        return freed

    def _remove(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None, "a root is never evicted"
        self._replace_child(parent, node, None)
        node.detached = True
        self._nodes -= 1
        if parent.is_leaf():
            if parent.parent is None:
                self._drop_root(parent)
            elif parent.lock_ref == 0:
                self._push_leaf(parent)

    def _drop_root(self, root: Node) -> None:
        del self._roots[self._root_names.pop(id(root))]

    def _root(self, namespace: str) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node(b"", [], None, 0, self._clock)
            self._root_names[id(root)] = namespace
        return root

    def _touched(self, node: Node) -> None:
        if is_evictable_leaf(node):
            self._push_leaf(node)

    def _push_leaf(self, node: Node) -> None:
        """Queue an evictable leaf; drop stale entries when they outnumber the nodes."""
        self._leaves.push(node)
        if len(self._leaves) > 2 * self._nodes + 64:
            self._leaves.compact()

    def _shadow_ids(self, count: int) -> range:
        """Fresh ids for a shadow's pages: a range, which holds no objects for the garbage
        collector to walk (a list of ints is walked by every collection of its generation)."""
        start = self._next_shadow_page
        self._next_shadow_page += count
        return range(start, start + count)


def _children(node: Node) -> list[Node]:
    return [*node.children.values(), *(node.overflow or {}).values()]


def _check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    return namespace


def _changed(pages: PageIds, cached: list[int]) -> list[int]:
    """Caller page ids at already-cached positions that differ from the cache's own ids."""
    mine = _as_ids(pages, 0, len(cached))
    if mine == cached:  # the usual engine call passes back the ids it matched
        return []
    return [page for page, kept in zip(mine, cached, strict=True) if page != kept]


def _as_ids(pages: PageIds, start: int, stop: int | None = None) -> list[int]:
    """``pages[start:stop]`` as a new list of Python ints."""
    if isinstance(pages, list):
        return pages[start:stop]
    if isinstance(pages, np.ndarray):
        ids: list[int] = pages[start:stop].tolist()
        return ids
    return [int(page) for page in pages[start:stop]]
