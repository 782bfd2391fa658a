"""Invariant checks of the radix tree, used by ``RadixCache.check``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from radix_cache.node import Node


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _children(node: Node) -> Iterator[Node]:
    yield from node.children.values()
    if node.overflow:
        yield from node.overflow.values()


def check_tree(
    roots: dict[str, Node],
    page_hash: Callable[[bytes], int],
    page_bytes: int,
    heap_nodes: set[int],
    counters: tuple[int, int, int],
) -> None:
    """Walk every namespace tree and compare it with the cache's counters and LRU heap.

    ``counters`` is ``(nodes, total_pages, locked_pages)`` as the cache tracks them.
    """
    seen_pages: set[int] = set()
    totals = [0, 0, 0]
    for name, root in roots.items():
        _require(root.parent is None and not root.pages, f"root of {name!r} holds pages")
        _require(not root.is_leaf(), f"empty root of namespace {name!r} was not dropped")
        stack = [root]
        while stack:
            node = stack.pop()
            _check_children(node, page_hash, page_bytes)
            for child in _children(node):
                _check_node(child, page_bytes, heap_nodes)
                for page in child.pages:
                    _require(page not in seen_pages, f"page {page} cached twice")
                    seen_pages.add(page)
                totals[0] += 1
                totals[1] += len(child.pages)
                totals[2] += len(child.pages) if child.lock_ref else 0
                stack.append(child)
    names = ("node count", "total_pages", "locked_pages")
    for name, counted, tracked in zip(names, totals, counters, strict=True):
        _require(counted == tracked, f"{name}: tree has {counted}, counter says {tracked}")


def _check_node(node: Node, page_bytes: int, heap_nodes: set[int]) -> None:
    _require(not node.detached, "detached node still in the tree")
    _require(len(node.pages) >= 1, "node without pages")
    _require(
        len(node.key) == len(node.pages) * page_bytes,
        f"node key of {len(node.key)} bytes for {len(node.pages)} pages",
    )
    below = sum(child.lock_ref for child in _children(node))
    _require(node.pins >= 0, "negative pin count")
    _require(
        node.lock_ref == node.pins + below,
        f"lock_ref {node.lock_ref} != pins {node.pins} + children's {below}",
    )
    parent = node.parent
    assert parent is not None
    if parent.parent is not None:
        _require(parent.last_access >= node.last_access, "child used more recently than parent")
    if node.lock_ref == 0 and node.is_leaf():
        _require(id(node) in heap_nodes, "evictable leaf missing from the LRU heap")


def _check_children(node: Node, page_hash: Callable[[bytes], int], page_bytes: int) -> None:
    firsts: set[bytes] = set()
    for hkey, child in node.children.items():
        first = child.key[:page_bytes]
        _require(child.parent is node, "child's parent pointer is wrong")
        _require(child.hkey == hkey == page_hash(first), "child keyed by a wrong hash")
        firsts.add(first)
    for first, child in (node.overflow or {}).items():
        _require(child.parent is node, "overflow child's parent pointer is wrong")
        _require(child.key[:page_bytes] == first, "overflow child keyed by a wrong page")
        _require(child.hkey == page_hash(first), "overflow child with a wrong hash")
        _require(first not in firsts, "two children start with the same page")
        firsts.add(first)
