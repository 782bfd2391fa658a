"""Cache models for upstreams that do not cache as a radix tree, and the model per kind.

- `SlotShadow`: a llama.cpp server keeps one KV sequence per slot and reuses the longest common
  prefix of the slot it runs a request on (the shadow keeps at most `max_bytes / slots` of
  each slot's tokens). The gateway pins each conversation to a slot with
  `id_slot` (and `cache_prompt: true`): a request that continues a slot's conversation goes to
  that slot; a new one takes an empty slot, else the least recently used one. Two sessions
  sharing a system prompt then never overwrite each other while a slot is free.
- `BreakpointShadow`: Anthropic caches the prefixes that end at a `cache_control` breakpoint
  (>= 1024 tokens), each for a time to live refreshed on every hit; a request reads the longest
  cached one that is a prefix of it.
`cache_model_for(kind, url)` picks the model for `--upstream KIND=URL`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import httpx
import xxhash

from gateway.config import UPSTREAM_KINDS
from gateway.shadow import CacheModel, Prompt, ShadowCache, ShadowConfig, as_prompt
from radix_cache import RadixCache

TOKEN_BYTES = 4


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Tokens two packed sequences share at their start (slice compares, doubling steps)."""
    n = min(len(a), len(b))
    lo, step = 0, 4096
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    else:
        return n // TOKEN_BYTES
    while hi - lo > TOKEN_BYTES:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = lo + (hi - lo) // 2 // TOKEN_BYTES * TOKEN_BYTES or lo + TOKEN_BYTES
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo // TOKEN_BYTES


K = TypeVar("K")
V = TypeVar("V")


class Bounded(Generic[K, V]):
    """A dict that keeps its `cap` most recently used entries."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._data: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.cap:
            self._data.popitem(last=False)
        return value


class Slot(NamedTuple):
    """What one llama.cpp slot holds: its namespace, packed tokens, last use."""

    namespace: str
    data: bytes
    used: float


class SlotChoice(NamedTuple):
    """The slot a prompt runs on and the prefix it reuses there."""

    slot: int
    length: int


class SlotShadow:
    """A llama.cpp server's slots (see the module docstring)."""

    #: a request continues a slot's conversation when it reuses this share of what it holds
    CONTINUES = 0.9

    def __init__(self, config: ShadowConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or ShadowConfig(page_size=1, slots=1)
        self._clock = clock
        self.slots: list[Slot | None] = [None] * self.config.slots
        self.misses = 0

    def resize(self, slots: int) -> None:
        """Take the slot count the server reports (`/props` total_slots)."""
        if slots > 0 and slots != len(self.slots):
            self.slots = (self.slots + [None] * slots)[:slots]

    def choose(self, prompt: Prompt, namespace: str) -> SlotChoice:
        """The continued slot, else an empty one, else the least recently used."""
        data = prompt.tokens.data
        best = SlotChoice(-1, 0)
        for i, slot in enumerate(self.slots):
            if slot is None or slot.namespace != namespace:
                continue
            length = common_prefix_tokens(slot.data, data)
            if length > best.length and length >= self.CONTINUES * len(slot.data) // TOKEN_BYTES:
                best = SlotChoice(i, length)
        if best.slot >= 0:
            return best
        empty = [i for i, s in enumerate(self.slots) if s is None]
        if empty:
            return SlotChoice(empty[0], 0)
        i = min(range(len(self.slots)), key=lambda k: self._used(k))
        old = self.slots[i]
        same = old is not None and old.namespace == namespace
        return SlotChoice(i, common_prefix_tokens(old.data, data) if same and old else 0)

    def _used(self, i: int) -> float:
        slot = self.slots[i]
        return -1.0 if slot is None else slot.used

    def match_length(self, prompt: Prompt | Any, namespace: str) -> int:
        return self.choose(as_prompt(prompt), namespace).length

    def predict(self, prompt: Prompt | Any, namespace: str) -> int:
        length = self.match_length(prompt, namespace)
        return length if length >= self.config.min_cached_tokens else 0

    def upstream_fields(self, prompt: Prompt, namespace: str) -> dict[str, Any]:
        """Pin the request to its slot and ask the server to reuse the slot's prefix; the
        slot is taken now (the server queues a request for a busy slot)."""
        slot = self.choose(prompt, namespace).slot
        self.slots[slot] = Slot(namespace, self._held(prompt.tokens.data), self._clock())
        return {"id_slot": slot, "cache_prompt": True}

    def _held(self, data: bytes) -> bytes:
        """What a slot keeps of a prompt: at most its share of `max_bytes` (a prefix, whole
        tokens), so all slots together stay within the budget."""
        share = self.config.max_bytes // len(self.slots) // TOKEN_BYTES * TOKEN_BYTES
        return data if len(data) <= share else data[:share]

    def record(self, prompt: Prompt | Any, namespace: str) -> None:
        """Store the prompt in its slot (already done when `upstream_fields` pinned it)."""
        prompt = as_prompt(prompt)
        choice = self.choose(prompt, namespace)
        slot = self.slots[choice.slot]
        data = self._held(prompt.tokens.data)
        if slot is None or slot.data != data:
            self.slots[choice.slot] = Slot(namespace, data, self._clock())

    def learn(self, prompt: Prompt | Any, namespace: str, predicted: int, reported: int) -> None:
        """A slot is rewritten by every request, so there is nothing to trim: count misses."""
        if predicted - reported > max(16, 0.02 * len(as_prompt(prompt))):
            self.misses += 1

    @property
    def pages(self) -> int:
        """Occupied slots (the router's tie-break prefers emptier replicas)."""
        return sum(slot is not None for slot in self.slots)


class BreakpointShadow:
    """Anthropic's cache: prefixes ending at breakpoints, each alive for `ttl_s` after use."""

    def __init__(self, config: ShadowConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or ShadowConfig(page_size=1, min_cached_tokens=1024)
        self._clock = clock
        self._tree = RadixCache(1)
        # state, not a memo (prompt_lint's LRU can be switched off), so a bounded dict of its own
        self._entries: Bounded[tuple[str, int], float] = Bounded(self.config.max_pages)
        # entry positions written, per namespace (the 4096 most recent namespaces)
        self._ends: Bounded[str, list[int]] = Bounded(4096)

    def _key(self, prompt: Prompt, end: int, namespace: str) -> tuple[str, int]:
        return namespace, xxhash.xxh3_64_intdigest(prompt.tokens.data[: end * TOKEN_BYTES])

    def _hit(self, prompt: Prompt, namespace: str, refresh: bool) -> int:
        """The longest live entry that is a prefix of the prompt, before its last breakpoint
        (a request reads through its breakpoints, looking back from each)."""
        if not prompt.breakpoints:
            return 0
        held = min(self._tree.match(prompt.tokens, namespace).length, max(prompt.breakpoints))
        now = self._clock()
        ends = [e for e in self._ends.get(namespace) or () if e <= held]
        for end in sorted(set(ends), reverse=True)[:16]:
            if end < self.config.min_cached_tokens:
                break
            key = self._key(prompt, end, namespace)
            expiry = self._entries.get(key)
            if expiry is not None and expiry > now:
                if refresh:
                    self._entries.put(key, now + self.config.ttl_s)
                return end
        return 0

    def match_length(self, prompt: Prompt | Any, namespace: str) -> int:
        return self._hit(as_prompt(prompt), namespace, refresh=False)

    def predict(self, prompt: Prompt | Any, namespace: str) -> int:
        return self.match_length(prompt, namespace)

    def upstream_fields(self, prompt: Prompt, namespace: str) -> dict[str, Any]:
        return {}

    def record(self, prompt: Prompt | Any, namespace: str) -> None:
        """The request wrote (or refreshed) an entry at each of its breakpoints."""
        prompt = as_prompt(prompt)
        self._hit(prompt, namespace, refresh=True)
        now = self._clock()
        ends = self._ends.get(namespace) or self._ends.put(namespace, [])
        for end in prompt.breakpoints:
            if end >= self.config.min_cached_tokens:
                self._entries.put(self._key(prompt, end, namespace), now + self.config.ttl_s)
                ends.append(end)
        del ends[:-256]  # the most recent positions (a namespace rarely needs more)
        self._tree.insert(prompt.tokens, None, namespace)
        over = self._tree.stats.total_pages - self.config.page_capacity(self.config.max_pages * 64)
        if over > 0:
            self._tree.evict(over)

    def learn(self, prompt: Prompt | Any, namespace: str, predicted: int, reported: int) -> None:
        """Entries past what was read expired early: forget them."""
        prompt = as_prompt(prompt)
        for end in prompt.breakpoints:
            if reported < end <= predicted:
                self._entries.put(self._key(prompt, end, namespace), 0.0)

    @property
    def pages(self) -> int:
        return len(self._entries)


def cache_model_for(kind: str, url: str, slots: int = 1) -> CacheModel:
    """The cache model for an upstream of `kind` (one of `UPSTREAM_KINDS`) at `url`."""
    if kind not in UPSTREAM_KINDS:
        raise ValueError(f"unknown upstream kind {kind!r}; known: {', '.join(UPSTREAM_KINDS)}")
    host = httpx.URL(url).host
    if kind == "llamacpp":
        return SlotShadow(ShadowConfig(page_size=1, slots=slots))
    if kind == "anthropic":
        return BreakpointShadow(ShadowConfig(page_size=1, min_cached_tokens=1024))
    if host.endswith("openai.com"):
        return ShadowCache(ShadowConfig(page_size=128, min_cached_tokens=1024))
    if host.endswith("deepseek.com"):
        return ShadowCache(ShadowConfig(page_size=64, min_cached_tokens=64))
    return ShadowCache(ShadowConfig(page_size=16))  # vLLM, SGLang, other self-hosted servers
