"""Failed authentication per client address: a wrong key now and then is a 401, a run of them
is a lockout.

An address whose presented keys were wrong `max_failures` times within `window_s` of the first
is locked for `window_s` from the last of them: its further attempts are refused with a 429 and
a `retry-after` (the seconds left) before any key is compared, and a refused attempt neither
counts nor extends the lock. Once the lock has passed the address starts a fresh window.

A key that authenticated from the address while it had failures on file stays accepted there
through a lock (an exact-match set lookup, never a comparison against other keys; at most
`MAX_KNOWN_KEYS` per address): a tenant behind the same NAT as a key-guesser keeps working.
A key never seen from the address is refused with the guesser's attempts until the lock passes.

Only addresses with failures are tracked, at most `max_addresses` (the oldest window is dropped
for a new one), so memory is bounded. A request with a valid key from an address with no failure
on file costs one dict lookup. The address is the one the server sees (`scope["client"]`):
the TCP peer, or behind a reverse proxy the address uvicorn's proxy-headers middleware takes
from `X-Forwarded-For` when the proxy's address is trusted (`FORWARDED_ALLOW_IPS`).

The limiter belongs to one process and lives on its event loop (no locking).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

from starlette.requests import HTTPConnection

from gateway.admission import Overloaded
from gateway.metrics import Counter

T = TypeVar("T")
MAX_ADDRESSES = 10_000  # addresses with failures on file; past it the oldest is dropped
MAX_KNOWN_KEYS = 16  # keys remembered per address as having authenticated from it
NO_ADDRESS = "unknown"  # a connection without a peer address (a Unix socket)


class Attempts:
    """One address's failures in its current window, and the keys that passed from it."""

    __slots__ = ("failures", "until", "known")

    def __init__(self, until: float, known: dict[str, None] | None = None) -> None:
        self.failures = 0
        self.until = until  # the window's end; once locked, the lock's end
        self.known: dict[str, None] = known if known is not None else {}


class AuthLimiter:
    """Counts failed authentication per address and refuses the attempts of a locked one.

    `verify(address, key, check)` is the whole protocol: it raises the 429 (`Overloaded`) for
    a locked address, else returns `check(key)` (None: a wrong key, counted as a failure)."""

    def __init__(self, max_failures: int, window_s: float, *,
                 max_addresses: int = MAX_ADDRESSES, clock: Callable[[], float] = time.monotonic,
                 refused: Counter | None = None) -> None:
        if max_failures < 0 or window_s <= 0 or max_addresses <= 0:
            raise ValueError("max_failures must be >= 0, window_s and max_addresses positive")
        self.max_failures = max_failures  # 0: no limit (nothing is tracked)
        self.window_s = window_s
        self.max_addresses = max_addresses
        self.clock = clock
        self.refused = refused
        self._by_address: dict[str, Attempts] = {}

    def __len__(self) -> int:
        """Addresses tracked now."""
        return len(self._by_address)

    def verify(self, address: str, key: str, check: Callable[[str], T | None]) -> T | None:
        """`check(key)` unless `address` is locked out (then `Overloaded`, 429, and `check` is
        never called); a None from `check` counts as a failure of `address`."""
        attempts = self._by_address.get(address)
        if attempts is None:  # the usual case: nothing on file, one lookup
            found = check(key)
            if found is None:
                self._failed(address)
            return found
        self._refuse_if_locked(attempts, key)
        found = check(key)
        if found is None:
            self._failed(address)
        elif key not in attempts.known:
            attempts.known[key] = None
            if len(attempts.known) > MAX_KNOWN_KEYS:
                del attempts.known[next(iter(attempts.known))]
        return found

    def _refuse_if_locked(self, attempts: Attempts, key: str) -> None:
        if attempts.failures < self.max_failures or key in attempts.known:
            return
        wait = attempts.until - self.clock()
        if wait <= 0:
            return
        if self.refused is not None:
            self.refused.inc()
        seconds = math.ceil(wait)
        raise Overloaded(429, "too many failed authentication attempts from this address; "
                              f"retry after {seconds} s", retry_after=seconds)

    def _failed(self, address: str) -> None:
        if self.max_failures == 0:
            return
        now = self.clock()
        attempts = self._by_address.get(address)
        if attempts is None or now >= attempts.until:
            attempts = self._new_window(address, now, attempts)
        attempts.failures += 1
        if attempts.failures == self.max_failures:
            attempts.until = now + self.window_s  # the lock lasts a whole window from here

    def _new_window(self, address: str, now: float, old: Attempts | None) -> Attempts:
        """A fresh window for `address`, at the back of the line (its known keys kept); the
        oldest window is dropped when the table is full."""
        self._by_address.pop(address, None)
        if len(self._by_address) >= self.max_addresses:
            del self._by_address[next(iter(self._by_address))]
        attempts = Attempts(now + self.window_s, old.known if old is not None else None)
        self._by_address[address] = attempts
        return attempts


def client_address(conn: HTTPConnection) -> str:
    """The address the server sees for the connection (after any trusted proxy's
    `X-Forwarded-For`, which uvicorn's middleware writes into the scope)."""
    client = conn.scope.get("client")
    return str(client[0]) if client else NO_ADDRESS
