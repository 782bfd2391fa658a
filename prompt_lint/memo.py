"""Bounded memos that let prompt_lint reuse work across requests.

Requests of one agent session repeat almost everything: the tool list, the
system prompt (but for a timestamp), the history. Each request arrives as a
fresh parsed JSON object, so object identity is no key; instead values are
keyed by their `marshal` bytes, which a C routine writes about ten times
faster than `json.dumps`. Equal marshal bytes load back to equal values with
equal key order and types, so a hit is always exact (a value marshal cannot
write, or two equal values with different internal sharing, is only a miss).

Every memo is an `LRU` bounded both by entries and by bytes (least recently
used entry dropped first; an entry's bytes are its key's and value's estimated
size, `approx_bytes`), so memory stays bounded whatever the input sizes;
`set_caching(False)` turns all of them off (tests compare the cached path with
the uncached one).
"""

from __future__ import annotations

import json
import marshal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_ENABLED = [True]
#: prompt_lint's memos (these LRUs, the shared TokenCounter, PieceMemos, learners) are
#: process-wide and not thread-safe: a caller that runs prompt_lint in a worker thread (the
#: gateway's lint stage and shadow tokenizing) holds this lock around the call.
LOCK = threading.RLock()
DEFAULT_MAX_BYTES = 64 << 20
_INT_BYTES = 32  # a boxed int beyond the small-int cache, plus its pointer


def approx_bytes(value: object) -> int:
    """Estimated memory held by `value`: exact for str/bytes, containers one level deep
    (their str/bytes/int items counted), other objects shallow."""
    size = sys.getsizeof(value)
    if isinstance(value, tuple | list):
        for item in value:
            size += sys.getsizeof(item) if isinstance(item, str | bytes) else _INT_BYTES
    elif isinstance(value, dict):
        for k, v in value.items():
            size += sys.getsizeof(k) + (sys.getsizeof(v) if isinstance(v, str | bytes)
                                        else _INT_BYTES)
    return size


def set_caching(enabled: bool) -> None:
    """Turn every prompt_lint cross-request memo on or off (process-wide)."""
    _ENABLED[0] = enabled


def caching() -> bool:
    """Whether cross-request memos are on."""
    return _ENABLED[0]


class LRU(Generic[K, V]):
    """A dict with a size cap: `get` refreshes an entry, `put` drops the oldest entries
    past `cap` entries or past `max_weight` bytes in all (an entry weighs what the caller
    says, else `approx_bytes` of its key and value). An entry heavier than the whole budget
    is not stored."""

    __slots__ = ("_data", "_weights", "cap", "max_weight", "weight")

    def __init__(self, cap: int, max_weight: int = DEFAULT_MAX_BYTES) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        if max_weight < 1:
            raise ValueError(f"max_weight must be >= 1, got {max_weight}")
        self.cap = cap
        self.max_weight = max_weight
        self.weight = 0
        self._data: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K) -> V | None:
        """The value at `key` (now most recently used), or None; always None when off."""
        if not _ENABLED[0]:
            return None
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V, weight: int | None = None) -> V:
        """Store `value` at `key` (nothing when caching is off); returns `value`."""
        if not _ENABLED[0]:
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
            old, _ = self._data.popitem(last=False)
            self.weight -= self._weights.pop(old, 0)
        return value

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
        found = memo.put(key, computed, len(key) + approx_bytes(computed))
    return found


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
#: Compact JSON texts of tools, messages and content blocks: at most 16384 values and
#: 32 MB of keys and texts together.
JSON_MEMO: LRU[bytes, str] = LRU(16384, max_weight=32 << 20)


def encode_compact(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))` (no memo)."""
    return _ENCODER.encode(value)


def compact_json_cached(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))`, memoised by value."""
    return memo_by_value(JSON_MEMO, value, encode_compact)
