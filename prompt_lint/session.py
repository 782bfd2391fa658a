"""Per-session state for cross-request checks and byte-stable rewriting.

A session is one conversation: successive requests whose history should
only grow. lint_request records each request's history fingerprints here
and compares the next request of the same session with them (history
append-only, PL009); rewrite_request remembers the messages it rewrote so
that when they come back as history it emits the same bytes again.

Session keys: the caller's explicit `session` string when given (the
gateway's conversation id), otherwise the prompt family plus the first
non-system message, which is what a conversation's turns share. Bounded:
at most `max_sessions` sessions and `max_rewrites` remembered messages,
least recently used dropped first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


def fingerprint(*parts: str) -> str:
    """A short stable hash of the parts."""
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


@dataclass(slots=True)
class SessionState:
    """What the last request of a session looked like: non-system message fingerprints."""

    history: list[str]
    indexes: list[int]


class SessionTracker:
    """Bounded map from session key to the last request's history."""

    def __init__(self, max_sessions: int = 4096, max_rewrites: int = 65536) -> None:
        if max_sessions < 1 or max_rewrites < 1:
            raise ValueError("max_sessions and max_rewrites must be >= 1")
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self._rewrites: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._max = max_sessions
        self._max_rewrites = max_rewrites

    def __len__(self) -> int:
        return len(self._states)

    def compare_and_record(self, key: str, history: list[str],
                           indexes: list[int]) -> int | None:
        """Record this request's history; return the message index where it
        stops being an append-only extension of the previous one, or None."""
        before = self._states.get(key)
        self._states[key] = SessionState(history, indexes)
        self._states.move_to_end(key)
        if len(self._states) > self._max:
            self._states.popitem(last=False)
        if before is None:
            return None
        for k, old in enumerate(before.history):
            if k >= len(history):
                return indexes[-1] if indexes else None
            if history[k] != old:
                return indexes[k]
        return None

    def remembered(self, key: str) -> dict[str, Any] | None:
        """A message rewrite_request emitted under `key` before, if any."""
        message = self._rewrites.get(key)
        if message is not None:
            self._rewrites.move_to_end(key)
        return message

    def remember(self, key: str, message: dict[str, Any]) -> None:
        """Keep the rewritten `message` so its history copies stay byte-identical."""
        self._rewrites[key] = message
        self._rewrites.move_to_end(key)
        if len(self._rewrites) > self._max_rewrites:
            self._rewrites.popitem(last=False)
