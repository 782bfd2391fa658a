"""Shadow prefix caches: predict what an upstream replica should have cached for a request.

An upstream does not tell us its cache, so the gateway keeps a `RadixCache` in shadow mode per
replica, fed with the tokens of every prompt that replica served. The match length before a
request is the *predicted* hit, stored beside the hit the upstream *reported*, so a user sees
when a provider caches less than the prompt allowed.

Prompts are tokenized in prompt_lint's token layout (`prompt_lint.layout`: tools, system
prompt, then messages, each segment through the shared chunk cache of `prompt_lint.tokens`),
so the gateway's shadow and the linter count the same tokens, a prompt that extends another
yields a token sequence that extends the other's, and text seen before is never re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.types import ChatRequest
from prompt_lint.layout import request_tokens
from prompt_lint.tokens import DEFAULT_ENCODING, shared_counter
from radix_cache import RadixCache

ENCODING = DEFAULT_ENCODING


def prompt_tokens(req: ChatRequest) -> list[int]:
    """Token ids of `req` in prompt_lint's layout (a raw /completions prompt: its text)."""
    if req.prompt is not None:
        return shared_counter(ENCODING).encode(req.prompt)
    return request_tokens(req.body, req.provider, ENCODING)


@dataclass(frozen=True, slots=True)
class ShadowConfig:
    """How one replica's shadow cache behaves.

    `page_size`: the upstream's caching granularity in tokens. `min_cached_tokens`: below
    this a provider caches nothing (OpenAI: 1024), so the prediction is 0. `max_pages`: the
    shadow's capacity; least recently used pages are evicted past it.
    """

    page_size: int = 16
    min_cached_tokens: int = 0
    max_pages: int = 1 << 16

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.min_cached_tokens < 0:
            raise ValueError(f"min_cached_tokens must be >= 0, got {self.min_cached_tokens}")
        if self.max_pages <= 0:
            raise ValueError(f"max_pages must be positive, got {self.max_pages}")


class ShadowCache:
    """A shadow `RadixCache` for one replica: prefix lengths in, predictions out."""

    def __init__(self, config: ShadowConfig | None = None) -> None:
        self.config = config or ShadowConfig()
        self._cache = RadixCache(self.config.page_size)

    def match_length(self, tokens: list[int], namespace: str) -> int:
        """Tokens of `tokens` this replica has seen as a prefix (page-aligned)."""
        return self._cache.match(tokens, namespace).length

    def predict(self, tokens: list[int], namespace: str) -> int:
        """The hit this replica should report for `tokens` (0 under the provider minimum)."""
        length = self.match_length(tokens, namespace)
        return length if length >= self.config.min_cached_tokens else 0

    def record(self, tokens: list[int], namespace: str) -> None:
        """Remember that the replica processed `tokens`; evict past capacity."""
        self._cache.insert(tokens, None, namespace)
        over = self._cache.stats.total_pages - self.config.max_pages
        if over > 0:
            self._cache.evict(over)

    @property
    def pages(self) -> int:
        """Pages held now."""
        return self._cache.stats.total_pages
