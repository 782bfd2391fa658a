"""Shadow prefix caches: predict what an upstream replica should have cached for a request.

An upstream does not tell us its cache, so the gateway keeps a model of it per replica, fed
with the tokens of every prompt that replica served. Its answer before a request is the
*predicted* hit, stored beside the hit the upstream *reported*; when the upstream reports
fewer cached tokens than predicted, the model `learn`s (drops what the upstream evidently
dropped and shrinks its capacity toward the upstream's). The models, one per way upstreams
cache (see `gateway.shadow_models` for slots and breakpoints):
- `ShadowCache`: a radix tree with LRU eviction (vLLM, SGLang; OpenAI's >= 1024-token,
  128-token-step rule and DeepSeek's 64-token pages are radix trees with other page sizes).

Prompts are tokenized in prompt_lint's token layout (`prompt_lint.providers.segments`: tools,
system prompt, then messages, each segment through the shared chunk cache of
`prompt_lint.tokens`), so the gateway's shadow and the linter count the same tokens, a prompt
that extends another yields a token sequence that extends the other's, and text seen before is
never re-tokenized. A request's tokens are packed once (`PackedTokens`) for every replica.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gateway.types import ChatRequest
from prompt_lint.layout import layout_of
from prompt_lint.providers import segments
from prompt_lint.tokens import DEFAULT_ENCODING, shared_counter
from prompt_lint.toolset import tool_set
from radix_cache import PackedTokens, RadixCache

ENCODING = DEFAULT_ENCODING
#: A shadow page beside its packed ids: its slot in a node's page-id list and the boxed id.
PAGE_OVERHEAD_BYTES = 48


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's tokens, packed once, with the offsets where a provider may place a cache
    breakpoint (end of tools, end of system prompt, start of the last user message)."""

    tokens: PackedTokens
    breakpoints: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)


def prompt_tokens(req: ChatRequest) -> list[int]:
    """Token ids of `req` in prompt_lint's layout (a raw /completions prompt: its text)."""
    return _layout(req)[0].tolist()


def request_prompt(req: ChatRequest) -> Prompt:
    """`req`'s tokens, packed, with its breakpoint offsets (what every cache model takes)."""
    ids, breakpoints = _layout(req)
    return Prompt(PackedTokens(np.frombuffer(ids, dtype=np.int32)), breakpoints)


def as_prompt(tokens: Sequence[int] | PackedTokens | Prompt) -> Prompt:
    """A Prompt for plain token ids (no breakpoints)."""
    if isinstance(tokens, Prompt):
        return tokens
    return Prompt(tokens if isinstance(tokens, PackedTokens) else PackedTokens(tokens))


NO_PROMPT = as_prompt(())  # what a router scores before a prompt's tokens are known


def _layout(req: ChatRequest) -> tuple[array[int], tuple[int, ...]]:
    """int32 token ids (an array: 4 bytes an id) and the breakpoint offsets; the segments
    are lint's when it laid the body out first (`LayoutShare`), else left for it."""
    counter = shared_counter(ENCODING)
    if req.prompt is not None:
        return array("i", counter.encode_cached(req.prompt)), ()
    out = array("i")
    marks: dict[str, int] = {}
    messages = req.body.get("messages") or []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    share = req.layout_share
    left = share.take(req.body) if share is not None else None
    if left is not None:
        toolset, segs = left.toolset, left.segments
    else:
        toolset = tool_set(req.body.get("tools") or [])
        segs = segments(req.body, req.provider, toolset)
    sizes: list[int] = []
    for seg in segs:
        if seg.message >= 0 and "tools" not in marks:
            marks["tools"] = len(out)
        if seg.message >= 0 and "system" not in marks and _past_system(messages, seg.message):
            marks["system"] = len(out)
        if seg.message == last_user and "history" not in marks:
            marks["history"] = len(out)
        ids = counter.encode_cached(seg.text)
        sizes.append(len(ids))
        out.extend(ids)
    if share is not None and left is None:  # for lint, which would count them again
        share.leave(req.body, layout_of(segs, sizes, toolset))
    return out, tuple(sorted({m for m in marks.values() if m > 0}))


def _past_system(messages: list[Any], index: int) -> bool:
    return index > 0 or messages[0].get("role") not in ("system", "developer")


@dataclass(frozen=True, slots=True)
class ShadowConfig:
    """How one replica's shadow cache behaves.

    `page_size`: the upstream's caching granularity in tokens. `min_cached_tokens`: below
    this a provider caches nothing (OpenAI: 1024), so the prediction is 0. `max_pages`: the
    shadow's capacity; least recently used pages are evicted past it (learning may lower it).
    `slots`: for llama.cpp servers, the KV slots per replica (one sequence each).
    `ttl_s`: for breakpoint caches (Anthropic), how long an unused entry lives.
    `max_bytes`: the shadow's memory budget; it caps the pages at `page_capacity()` (a
    shadow page holds its packed token ids and a page id: `page_bytes`).
    """

    page_size: int = 16
    min_cached_tokens: int = 0
    max_pages: int = 1 << 16
    slots: int = 1
    ttl_s: float = 300.0
    max_bytes: int = 16 << 20

    def page_bytes(self) -> int:
        """Estimated bytes of one shadow page: packed int32 ids, a list slot, a boxed id."""
        return 4 * self.page_size + PAGE_OVERHEAD_BYTES

    def page_capacity(self, pages: int | None = None) -> int:
        """`pages` (default `max_pages`) capped by what fits in `max_bytes`."""
        return max(1, min(self.max_pages if pages is None else pages,
                          self.max_bytes // self.page_bytes()))

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.min_cached_tokens < 0:
            raise ValueError(f"min_cached_tokens must be >= 0, got {self.min_cached_tokens}")
        if self.max_pages <= 0:
            raise ValueError(f"max_pages must be positive, got {self.max_pages}")
        if self.slots <= 0:
            raise ValueError(f"slots must be positive, got {self.slots}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")


class CacheModel(Protocol):
    """How one upstream replica caches, as the router and the pool use it.

    `match_length` is the routing score (the prefix this replica would reuse);
    `predict` the hit the replica should report (0 under the provider's minimum);
    `upstream_fields` body fields that steer the upstream's cache (llama.cpp: `id_slot`), and
    `steers` whether there can be any (when not, the body sent does not depend on the prompt's
    tokens);
    `record` is called once the replica has prefilled the prompt; `learn` when the replica
    reported `reported` cached tokens where `predicted` were expected (both in shadow tokens);
    `finished` once the answer of a request `upstream_fields` was asked for has ended (or
    failed): a llama.cpp slot is busy until then.
    """

    config: ShadowConfig

    @property
    def steers(self) -> bool: ...

    def match_length(self, prompt: Prompt, namespace: str) -> int: ...
    def predict(self, prompt: Prompt, namespace: str) -> int: ...
    def upstream_fields(self, prompt: Prompt, namespace: str) -> dict[str, Any]: ...
    def record(self, prompt: Prompt, namespace: str) -> None: ...
    def learn(self, prompt: Prompt, namespace: str, predicted: int, reported: int) -> None: ...
    def finished(self, prompt: Prompt, namespace: str) -> None: ...

    @property
    def pages(self) -> int: ...


def missed(config: ShadowConfig, prompt: Prompt, predicted: int, reported: int) -> bool:
    """True when the upstream evidently cached less than predicted: short by more than a page
    and 2% of the prompt (tokenizer differences make smaller gaps noise)."""
    return predicted - reported > max(config.page_size, 0.02 * len(prompt))


class ShadowCache:
    """A radix tree with LRU eviction: what vLLM and SGLang (and OpenAI's rule) cache."""

    steers = False

    def __init__(self, config: ShadowConfig | None = None) -> None:
        self.config = config or ShadowConfig()
        self.capacity = self.config.page_capacity()
        self.trimmed_pages = 0
        self._cache = RadixCache(self.config.page_size)

    def match_length(self, prompt: Prompt | Sequence[int], namespace: str) -> int:
        """Tokens of the prompt this replica has seen as a prefix (page-aligned)."""
        return self._cache.match(as_prompt(prompt).tokens, namespace).length

    def predict(self, prompt: Prompt | Sequence[int], namespace: str) -> int:
        """The hit this replica should report (0 under the provider minimum)."""
        length = self.match_length(prompt, namespace)
        return length if length >= self.config.min_cached_tokens else 0

    def upstream_fields(self, prompt: Prompt, namespace: str) -> dict[str, Any]:
        """Nothing to steer: a radix cache finds prefixes by itself."""
        return {}

    def record(self, prompt: Prompt | Sequence[int], namespace: str) -> None:
        """Remember that the replica processed the prompt; evict past capacity."""
        self._cache.insert(as_prompt(prompt).tokens, None, namespace)
        self._evict()

    def learn(self, prompt: Prompt | Sequence[int], namespace: str, predicted: int,
              reported: int) -> None:
        """The replica reported `reported` where `predicted` was expected: what extended the
        reported prefix is gone (the prompt itself is cached again now), and the replica
        holds no more than the shadow keeps after dropping it."""
        prompt = as_prompt(prompt)
        if missed(self.config, prompt, reported, predicted):  # it held more: room to grow
            grow = (reported - predicted) // self.config.page_size
            self.capacity = self.config.page_capacity(self.capacity + grow)
        if not missed(self.config, prompt, predicted, reported):
            return
        dropped = self._cache.truncate(prompt.tokens, max(reported, 0), namespace)
        self.trimmed_pages += len(dropped)
        own = len(prompt) // self.config.page_size
        self.capacity = self.config.page_capacity(max(own, self._cache.stats.total_pages))
        self._cache.insert(prompt.tokens, None, namespace)
        self._evict()

    def finished(self, prompt: Prompt, namespace: str) -> None:
        """Nothing is held per request."""

    def _evict(self) -> None:
        over = self._cache.stats.total_pages - self.capacity
        if over > 0:
            self._cache.evict(over)

    @property
    def pages(self) -> int:
        """Pages held now."""
        return self._cache.stats.total_pages
