"""What a request's backend stream has delivered so far, for the record of a request that ends
before its answer does (the client went away, the backend failed mid-stream).

Such a request was still prefilled and decoded: its record keeps the prompt and cached tokens
its stream's head reported and the completion tokens generated until it stopped, rather than
zeros. The engine counts its tokens exactly; an upstream's chunks are counted one token each,
and the record is then marked estimated (`Usage.estimated`), as for an upstream that sends no
usage at all.
"""

from __future__ import annotations

from gateway.evolve import evolve
from gateway.types import TextDelta, Usage


class Progress:
    """The usage a stream's first item carried and the completion tokens of every item since."""

    __slots__ = ("early", "estimated", "tokens")

    def __init__(self) -> None:
        self.early: Usage | None = None
        self.tokens = 0
        self.estimated = False

    def see(self, item: TextDelta) -> None:
        if self.early is None:
            self.early = item.usage
        if item.tokens is None:
            if item.text or item.tool_calls or item.provider_events:
                self.tokens += 1
                self.estimated = True
        else:
            self.tokens += item.tokens

    def usage(self) -> Usage | None:
        """The usage so far; None before the stream's head reported any."""
        early = self.early
        if early is None:
            return None
        return evolve(early, completion_tokens=self.tokens,
                      estimated=early.estimated or self.estimated)
