"""The token layout of a request: where each segment starts, in tokens."""

from __future__ import annotations

from itertools import accumulate
from typing import Any, NamedTuple

from prompt_lint.providers import Provider, Segment, detect_provider, segments
from prompt_lint.tokens import DEFAULT_ENCODING, TokenCounter, shared_counter
from prompt_lint.toolset import ToolSet, tool_set


class TokenLayout(NamedTuple):
    """Segments in cache order with their token start offsets and sizes (`exact`: tokens
    counted exactly from the start when the sizes past them are estimates, `rule_layout`;
    None when every size is exact)."""

    segments: list[Segment]
    starts: list[int]
    sizes: list[int]
    total: int
    paths: dict[str, int]
    toolset: ToolSet | None = None  # the tool list's facts the segments were made with
    exact: int | None = None

    def start_of(self, path: str) -> int | None:
        """Token offset where the segment at `path` starts (None if unknown)."""
        i = self.paths.get(path)
        return None if i is None else self.starts[i]

    def message_start(self, message: int) -> int:
        """Token offset of message `message`'s header."""
        found = self.start_of(f"messages[{message}]")
        return self.total if found is None else found


def token_layout(body: dict[str, Any], provider: Provider, counter: TokenCounter,
                 toolset: ToolSet | None = None) -> TokenLayout:
    """Tokenize each segment of `body` (through the counter's chunk cache)."""
    if toolset is None:
        toolset = tool_set(body.get("tools") or [])
    segs = segments(body, provider, toolset)
    return layout_of(segs, counter.count_segments(segs), toolset)


def rule_layout(body: dict[str, Any], provider: Provider, counter: TokenCounter,
                minimum: int) -> TokenLayout:
    """A layout exact enough for the rule ids of an OpenAI-format request: once the segments
    counted exactly from the start reach `minimum` tokens (the provider's minimum cacheable
    prefix), every later segment that holds no template material (the conversation's
    messages) gets an estimate: it is neither tokenized nor looked up. No rule id depends on
    those counts: PL010 (the one that counts tokens) fires when the prompt reaches the minimum
    and its stable prefix does not, and a prefix already past it decides both. Token offsets
    and totals past `exact` are estimates; template text (scanned for dynamic values) is
    always counted. Anthropic requests (whose breakpoint checks compare offsets anywhere in
    the prompt) are counted whole."""
    if provider != "openai":
        return token_layout(body, provider, counter)
    toolset = tool_set(body.get("tools") or [])
    segs = segments(body, provider, toolset)
    sizes: list[int] = []
    exact: int | None = None
    done = 0
    for seg in segs:
        if done >= minimum and not seg.scan:
            if exact is None:
                exact = done  # from here on, a message's count is estimated
            n = estimate(seg.text)
        else:
            known = counter.known_count(seg.text)
            n = counter.count_at(seg.text, seg.path) if known is None else known
        sizes.append(n)
        done += n
    return layout_of(segs, sizes, toolset)._replace(exact=exact)


def estimate(text: str) -> int:
    """A token count for `text` without tokenizing it (about four characters a token)."""
    return len(text) // 4 + 1


def layout_of(segs: list[Segment], sizes: list[int], toolset: ToolSet | None = None
              ) -> TokenLayout:
    """The layout of segments whose token counts are known (a caller that encoded each
    segment already: `sizes[i]` is segment i's count; `toolset`: the ToolSet `segs` were
    made with, kept so that a lint of the same body does not look it up again)."""
    starts = list(accumulate(sizes, initial=0))
    total = starts.pop()
    return TokenLayout(segs, starts, sizes, total, {s.path: i for i, s in enumerate(segs)},
                       toolset)


def request_tokens(body: dict[str, Any], provider: Provider | None = None,
                   encoding: str | None = None) -> list[int]:
    """The token ids of `body` in cache order (tools, system, messages).

    This is the token sequence prompt_lint counts with, and what a replay
    through a prefix cache should use; equal prefixes of two requests give
    equal token prefixes.
    """
    counter = shared_counter(encoding or DEFAULT_ENCODING)
    out: list[int] = []
    for seg in segments(body, provider or detect_provider(body)):
        out.extend(counter.encode(seg.text))
    return out
