"""Cache models for upstreams that do not cache as a radix tree, and the model per kind.

- `SlotShadow` (gateway.llama_slots): a llama.cpp server's slots and its host prompt cache.
- `BreakpointShadow`: Anthropic caches the prefixes that end at a `cache_control` breakpoint
  (>= 1024 tokens), each for a time to live refreshed on every hit; a request reads the longest
  cached one that is a prefix of it.
`cache_model_for(kind, url)` picks the model for `--upstream KIND=URL`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import httpx
import xxhash

from gateway.config import UPSTREAM_KINDS
from gateway.llama_slots import TOKEN_BYTES, SlotShadow
from gateway.shadow import CacheModel, Prompt, ShadowCache, ShadowConfig, as_prompt
from radix_cache import RadixCache

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


class BreakpointShadow:
    """Anthropic's cache: prefixes ending at breakpoints, each alive for `ttl_s` after use."""

    steers = False

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

    def finished(self, prompt: Prompt, namespace: str) -> None:
        """Nothing is held per request."""

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
    if kind == "sglang":  # SGLang's radix cache is token-granular (page size 1 by default)
        return ShadowCache(ShadowConfig(page_size=1))
    return ShadowCache(ShadowConfig(page_size=16))  # vLLM's 16-token blocks, other servers
