"""Tree node of the radix cache: a compressed edge of one or more whole pages."""

from __future__ import annotations

from collections.abc import Sequence


class Node:
    """A run of cached pages hanging below ``parent``.

    ``key`` holds the tokens of all ``pages`` as packed int32 bytes (``page_bytes`` per page);
    ``pages`` is the engine's list of KV page ids, or a shadow's range of ids.
    ``children`` maps the 64-bit hash of a child's first page to the child; ``overflow`` keeps
    the rare child whose first-page hash collides with a sibling's, keyed by its first page.
    ``pins`` counts locks taken on this very node and ``lock_ref`` the locks held on this node
    or any descendant. ``parent is None`` marks
    a namespace root (which holds no pages) or, with ``detached``, a node that was evicted.
    """

    __slots__ = (
        "key",
        "pages",
        "parent",
        "children",
        "overflow",
        "hkey",
        "lock_ref",
        "pins",
        "last_access",
        "detached",
    )

    def __init__(
        self, key: bytes, pages: Sequence[int], parent: Node | None, hkey: int, now: int
    ) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.overflow: dict[bytes, Node] | None = None
        self.hkey = hkey
        self.lock_ref = 0
        self.pins = 0
        self.last_access = now
        self.detached = False

    def is_leaf(self) -> bool:
        """True when no child hangs below this node."""
        return not self.children and not self.overflow

    def __repr__(self) -> str:
        return f"Node(pages={len(self.pages)}, lock_ref={self.lock_ref}, t={self.last_access})"
