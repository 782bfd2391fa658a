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
    """

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
    ) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._include_stop = include_stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self._emitted = 0

    def add(self, token_id: int) -> None:
        """Decode one more token; cut the text and set `stopped` when a stop string appears."""
        if self.stopped:
            raise RuntimeError("token added after a stop string ended the text")
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += self._decoder.decode(self._token_bytes(token_id))
        self._find_stop(start)

    def flush(self) -> None:
        """End of sequence: decode any held incomplete bytes (as U+FFFD)."""
        if not self.stopped:
            start = max(0, len(self.text) - self._longest_stop + 1)
            self.text += self._decoder.decode(b"", final=True)
            self._find_stop(start)

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out that is safe to show now (all of it when `final`)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        if end <= self._emitted:
            return ""
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece

    def _find_stop(self, start: int) -> None:
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self.text = self.text[: index + (len(stop) if self._include_stop else 0)]
        self.stopped = True
        self.stop_string = stop

    def _held(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:size]):
                    best = size
                    break
        return best
