"""Per-session state for cross-request checks and byte-stable rewriting.

A session is one conversation: successive requests whose history should
only grow. lint_request records each request's history fingerprints here
and compares the next request of the same session with them (history
append-only, PL009); rewrite_request remembers the messages it rewrote so
that when they come back as history it emits the same bytes again.

Session keys: the caller's explicit `session` string when given (the
gateway's conversation id), otherwise the prompt family plus the first
non-system message, which is what a conversation's turns share. Bounded by
bytes (`max_bytes`, half for histories, half for remembered messages) and by
entries (`max_sessions` sessions, `max_rewrites` messages), least recently used
dropped first.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from prompt_lint.memo import LRU, approx_bytes, text_bytes

#: Estimated bytes of one history entry: a 24-character fingerprint str, its list slot and
#: its message index (a list slot and a boxed int).
HISTORY_ENTRY_BYTES = 73 + 8 + 40


def fingerprint(*parts: str) -> str:
    """A short stable hash of the parts."""
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


#: levels `remember` weighs a message to (a request body is at most 64 levels deep by default)
MESSAGE_DEPTH = 64


@dataclass(slots=True)
class SessionState:
    """What the last request of a session looked like: non-system message fingerprints."""

    history: list[str]
    indexes: list[int]


class SessionTracker:
    """Bounded map from session key to the last request's history (and rewritten messages)."""

    def __init__(self, max_sessions: int = 4096, max_rewrites: int = 65536,
                 max_bytes: int = 8 << 20) -> None:
        if max_sessions < 1 or max_rewrites < 1:
            raise ValueError("max_sessions and max_rewrites must be >= 1")
        if max_bytes < 2:
            raise ValueError(f"max_bytes must be >= 2, got {max_bytes}")
        # state, not memos: set_caching(False) must not turn them off
        self._states: LRU[str, SessionState] = LRU(max_sessions, max_bytes // 2,
                                                   switchable=False)
        self._rewrites: LRU[str, dict[str, Any]] = LRU(max_rewrites, max_bytes // 2,
                                                       switchable=False)

    def __len__(self) -> int:
        return len(self._states)

    def memos(self) -> dict[str, LRU[Any, Any]]:
        """The byte-bounded stores by name (for accounting and tests)."""
        return {"session_histories": self._states, "session_rewrites": self._rewrites}

    def compare_and_record(self, key: str, history: list[str],
                           indexes: list[int]) -> int | None:
        """Record this request's history; return the message index where it
        stops being an append-only extension of the previous one, or None.

        A history that is a prefix of the previous one (a retry from an earlier turn, or a
        new conversation that opens like one before it and so shares its session key) is
        no edit: every message it sends is already cached, so it is not reported."""
        before = self._states.get(key)
        weight = text_bytes(key) + 2 * 56 + HISTORY_ENTRY_BYTES * len(history)
        self._states.put(key, SessionState(history, indexes), weight)
        if before is None:
            return None
        for k, (new, old) in enumerate(zip(history, before.history, strict=False)):
            if new != old:
                return indexes[k]
        return None

    def remembered(self, key: str) -> dict[str, Any] | None:
        """A message rewrite_request emitted under `key` before, if any."""
        return self._rewrites.get(key)

    def remember(self, key: str, message: dict[str, Any]) -> None:
        """Keep the rewritten `message` so its history copies stay byte-identical; weighed to
        its deepest string (a screenshot inside a tool_result is 6 levels down: the default
        depth of 4 weighed a megabyte image as a kilobyte, and the store held thousands)."""
        weight = text_bytes(key) + approx_bytes(message, depth=MESSAGE_DEPTH)
        self._rewrites.put(key, message, weight)
