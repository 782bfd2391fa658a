"""Bounded memos that let prompt_lint reuse work across requests.

Requests of one agent session repeat almost everything: the tool list, the
system prompt (but for a timestamp), the history. Each request arrives as a
fresh parsed JSON object, so object identity is no key; instead values are
keyed by their `marshal` bytes, which a C routine writes about ten times
faster than `json.dumps`. Equal marshal bytes load back to equal values with
equal key order and types, so a hit is always exact (a value marshal cannot
write, or two equal values with different internal sharing, is only a miss).

Every memo is an `LRU` bounded by bytes (and by entries; least recently used
entry dropped first; an entry's bytes are its key's and value's estimated size:
`text_bytes`, `ids_bytes`, `approx_bytes`), with its budget named in
`prompt_lint.budgets`, so memory stays bounded whatever the input sizes;
`set_caching(False)` turns all of them off (tests compare the cached path with
the uncached one).
"""

from __future__ import annotations

import json
import marshal
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sized
from typing import Any, Generic, TypeVar

from prompt_lint.budgets import BUDGETS

K = TypeVar("K")
V = TypeVar("V")

_ENABLED = [True]
#: prompt_lint's memos (these LRUs, the shared TokenCounter, PieceMemos, learners) are
#: process-wide and not thread-safe: a caller that runs prompt_lint in a worker thread (the
#: gateway's lint stage and shadow tokenizing) holds this lock around the call.
LOCK = threading.RLock()
DEFAULT_MAX_BYTES = 64 << 20
_INT_BYTES = 32  # a boxed int beyond the small-int cache, plus its pointer


def approx_bytes(value: object, depth: int = 4) -> int:
    """Estimated memory held by `value`: exact for str/bytes, 32 bytes a number, tuples
    (NamedTuples too), lists, sets and dicts with their items down to `depth` levels, other
    objects shallow (shared objects are counted at every place they appear)."""
    if isinstance(value, str | bytes):
        return sys.getsizeof(value)
    if isinstance(value, int | float):
        return _INT_BYTES
    size = sys.getsizeof(value)
    if depth <= 0:
        return size
    if isinstance(value, tuple | list | set | frozenset):
        size += sum(approx_bytes(item, depth - 1) for item in value)
    elif isinstance(value, dict):
        size += sum(approx_bytes(k, depth - 1) + approx_bytes(v, depth - 1)
                    for k, v in value.items())
    return size


def text_bytes(text: str | bytes) -> int:
    """Bytes a str or bytes object holds (exact, O(1))."""
    return sys.getsizeof(text)


def ids_bytes(ids: Sized) -> int:
    """Estimated bytes of a sequence of token ids: the object itself when it knows its size
    (an `array`), else 8 bytes a slot plus a 32-byte boxed int per id (a tuple or list)."""
    if isinstance(ids, array):
        return sys.getsizeof(ids)
    return sys.getsizeof(ids) + _INT_BYTES * len(ids)


def set_caching(enabled: bool) -> None:
    """Turn every prompt_lint cross-request memo on or off (process-wide)."""
    _ENABLED[0] = enabled


def caching() -> bool:
    """Whether cross-request memos are on."""
    return _ENABLED[0]


class LRU(Generic[K, V]):
    """A dict with a byte budget: `get` refreshes an entry, `put` drops the least recently
    used entries past `max_weight` bytes in all (and past `cap` entries). An entry weighs
    what the caller says (its key's and value's estimated bytes: `text_bytes`, `ids_bytes`),
    else `approx_bytes` of its key and value; `weight` is the sum over the entries held. An
    entry heavier than the whole budget is not stored. `evicted(key, value)` is called for
    every entry dropped to make room (the owner unlinks indexes of its own).

    A memo (the default) is off while `set_caching(False)`: nothing found, nothing stored. A
    store of state (`switchable=False`: families, sessions) keeps working."""

    __slots__ = ("_data", "_weights", "cap", "evicted", "max_weight", "switchable", "weight")

    def __init__(self, cap: int, max_weight: int = DEFAULT_MAX_BYTES, *,
                 evicted: Callable[[K, V], None] | None = None,
                 switchable: bool = True) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        if max_weight < 1:
            raise ValueError(f"max_weight must be >= 1, got {max_weight}")
        self.cap = cap
        self.max_weight = max_weight
        self.weight = 0
        self.evicted = evicted
        self.switchable = switchable
        self._data: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._data))

    def values(self) -> list[V]:
        """The values, least recently used first (a copy)."""
        return list(self._data.values())

    def _on(self) -> bool:
        return _ENABLED[0] or not self.switchable

    def get(self, key: K) -> V | None:
        """The value at `key` (now most recently used), or None; always None when off."""
        if not self._on():
            return None
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value at `key` without refreshing it (None when absent or off)."""
        return self._data.get(key) if self._on() else None

    def put(self, key: K, value: V, weight: int | None = None) -> V:
        """Store `value` at `key` (nothing when caching is off); returns `value`."""
        if not self._on():
            return value
        if weight is None:
            weight = approx_bytes(key) + approx_bytes(value)
        if weight > self.max_weight:
            return value
        self.weight += weight - self._weights.pop(key, 0)
        self._weights[key] = weight
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.cap or self.weight > self.max_weight:
            old, old_value = self._data.popitem(last=False)
            self.weight -= self._weights.pop(old, 0)
            if self.evicted is not None:
                self.evicted(old, old_value)
        return value

    def resize(self, max_weight: int) -> None:
        """Change the byte budget; drops least recently used entries past a smaller one."""
        if max_weight < 1:
            raise ValueError(f"max_weight must be >= 1, got {max_weight}")
        self.max_weight = max_weight
        while self.weight > self.max_weight and self._data:
            old, old_value = self._data.popitem(last=False)
            self.weight -= self._weights.pop(old, 0)
            if self.evicted is not None:
                self.evicted(old, old_value)

    def reweigh(self, key: K, weight: int) -> None:
        """Set the weight of the entry at `key` (it grew in place); evicts past the budget,
        the entry itself last."""
        value = self._data.get(key)
        if value is None:
            return
        if weight > self.max_weight:
            self.pop(key)
            if self.evicted is not None:
                self.evicted(key, value)
            return
        self.put(key, value, weight)

    def pop(self, key: K) -> V | None:
        """Remove and return the entry at `key` (None when absent); no `evicted` call."""
        self.weight -= self._weights.pop(key, 0)
        return self._data.pop(key, None)

    def oldest(self) -> K | None:
        """The least recently used key, or None when empty."""
        return next(iter(self._data), None)

    def items(self) -> list[tuple[K, V]]:
        """The entries, least recently used first (a copy)."""
        return list(self._data.items())

    def weights(self) -> dict[K, int]:
        """Each entry's accounted bytes (a copy)."""
        return dict(self._weights)

    def clear(self) -> None:
        """Drop every entry."""
        self._data.clear()
        self._weights.clear()
        self.weight = 0


def value_key(value: Any) -> bytes | None:
    """An exact key for a JSON-like value (its marshal bytes), or None if marshal refuses it."""
    try:
        return marshal.dumps(value)
    except ValueError:
        return None


def memo_by_value(memo: LRU[bytes, V], value: Any, compute: Callable[[Any], V]) -> V:
    """`compute(value)` through `memo`, keyed by `value_key(value)`."""
    key = value_key(value) if _ENABLED[0] else None
    if key is None:
        return compute(value)
    found = memo.get(key)
    if found is None:
        computed = compute(value)
        found = memo.put(key, computed, text_bytes(key) + approx_bytes(computed))
    return found


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
#: Compact JSON texts of tools, messages and content blocks: at most 16384 values and
#: `BUDGETS.json_texts` bytes of keys and texts together.
JSON_MEMO: LRU[bytes, str] = LRU(16384, max_weight=BUDGETS.json_texts)


def encode_compact(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))` (no memo)."""
    return _ENCODER.encode(value)


def compact_json_cached(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))`, memoised by value."""
    return memo_by_value(JSON_MEMO, value, encode_compact)
