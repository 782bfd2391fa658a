"""Incremental, UTF-8 safe detokenization with stop-string detection for one sequence."""

from __future__ import annotations

import codecs
from collections.abc import Callable


class IncrementalDetokenizer:
    """Appends tokens' bytes, keeps the decoded text and finds stop strings.

    Bytes of a character split across tokens are held until the character completes (the
    incremental UTF-8 decoder), so no delta ever carries half a character. `delta()` also holds
    back any tail that could still grow into a stop string, so a stream never shows part of a
    stop string that is later cut.

    With `free_text_until`, stop strings are matched only in the text before that marker's
    first occurrence (a match must end before it): what follows is grammar-shaped output (a
    tool call) that a stop string must not cut. "" means no free text at all. A match that the
    marker may still begin inside of (stop "<" as the model writes "<tool_call>") waits for the
    next tokens to tell; nothing from it on is handed out meanwhile.
    """

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        free_text_until: str | None = None,
    ) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._include_stop = include_stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._marker = free_text_until
        self._free_end: int | None = 0 if free_text_until == "" else None  # once known
        self._pending: int | None = None  # where a match waits to see whether the marker opens
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self._emitted = 0

    def add(self, token_id: int) -> None:
        """Decode one more token; cut the text and set `stopped` when a stop string appears."""
        if self.stopped:
            raise RuntimeError("token added after a stop string ended the text")
        before = len(self.text)
        self.text += self._decoder.decode(self._token_bytes(token_id))
        self._find_stop(before)

    def flush(self) -> None:
        """End of sequence: decode any held incomplete bytes (as U+FFFD)."""
        if not self.stopped:
            before = len(self.text)
            self.text += self._decoder.decode(b"", final=True)
            self._find_stop(before, final=True)

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out that is safe to show now (all of it when `final`)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        if self._pending is not None and not final:
            end = min(end, self._pending)
        if end <= self._emitted:
            return ""
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece

    def _find_stop(self, before: int, final: bool = False) -> None:
        """Look for a stop string in what the text gained after its first `before` characters
        (a match may begin up to the longest stop string earlier), within the free text; at the
        `final` text a waiting match no longer waits."""
        if not self._stop:
            return
        if self._free_end is None and self._marker is not None:
            at = self.text.find(self._marker, max(0, before - len(self._marker) + 1))
            self._free_end = at if at >= 0 else None
        end = len(self.text) if self._free_end is None else self._free_end
        start = max(0, before - self._longest_stop + 1)
        if self._pending is not None:
            start, self._pending = min(start, self._pending), None
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, start, end)) >= 0]
        if not hits:
            return
        index, stop = min(hits)
        if not final and self._marker_may_open(index, index + len(stop)):
            self._pending = index
            return
        self.text = self.text[: index + (len(stop) if self._include_stop else 0)]
        self.stopped = True
        self.stop_string = stop

    def _marker_may_open(self, lo: int, hi: int) -> bool:
        """Whether the marker, not written yet, may still begin inside text[lo:hi] (the text
        from some position there to the end is a start of the marker)."""
        if self._free_end is not None or not self._marker:
            return False
        first = max(lo, len(self.text) - len(self._marker) + 1)
        return any(self._marker.startswith(self.text[j:]) for j in range(first, hi))

    def _held(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string (none
        once the free text has ended: no stop string can match after it)."""
        if self._free_end is not None:
            return 0
        best = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:size]):
                    best = size
                    break
        return best
