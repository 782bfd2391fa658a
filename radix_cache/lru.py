"""Least-recently-used order over evictable leaves: a heap with lazy invalidation."""

from __future__ import annotations

import heapq
from itertools import count

from radix_cache.node import Node


def is_evictable_leaf(node: Node) -> bool:
    """True for an attached, unlocked, childless non-root node."""
    return node.parent is not None and not node.detached and node.lock_ref == 0 and node.is_leaf()


class LeafHeap:
    """Heap of ``(last_access, seq, node)`` entries; stale entries are skipped when popped.

    An entry is valid while its node is an evictable leaf whose ``last_access`` still equals the
    entry's time. Callers push whenever a node becomes an evictable leaf or is touched while one;
    nothing is ever searched or removed from the middle, so eviction never scans the tree.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, Node]] = []
        self._seq = count()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, node: Node) -> None:
        """Record ``node`` as evictable at its current ``last_access``."""
        heapq.heappush(self._entries, (node.last_access, next(self._seq), node))

    def peek(self) -> Node | None:
        """The least recently used evictable leaf, dropping stale entries on the way."""
        entries = self._entries
        while entries:
            stamp, _, node = entries[0]
            if stamp == node.last_access and is_evictable_leaf(node):
                return node
            heapq.heappop(entries)
        return None

    def pop(self) -> None:
        """Drop the entry ``peek`` returned."""
        heapq.heappop(self._entries)

    def compact(self) -> None:
        """Rebuild without stale or repeated entries."""
        seen: set[int] = set()
        kept: list[tuple[int, int, Node]] = []
        for entry in self._entries:
            node = entry[2]
            if entry[0] == node.last_access and is_evictable_leaf(node) and id(node) not in seen:
                seen.add(id(node))
                kept.append(entry)
        heapq.heapify(kept)
        self._entries = kept

    def valid_nodes(self) -> set[int]:
        """Ids of nodes with a valid entry (for invariant checks)."""
        return {
            id(node)
            for stamp, _, node in self._entries
            if stamp == node.last_access and is_evictable_leaf(node)
        }
