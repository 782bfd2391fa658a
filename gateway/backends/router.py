"""Replica choice: longest cached prefix unless load is unbalanced, and replica health.

The rule follows SGLang's cache-aware router. If the busiest replica has more than
`balance_abs` requests in flight beyond the idlest one *and* more than `balance_rel` times as
many, the least loaded replica wins. Otherwise the replica whose shadow cache holds the longest
prefix of the prompt wins when that prefix covers at least `cache_threshold` of it; else the
least loaded (then emptiest, then next in rotation) replica takes the new prefix.

A replica that fails (timeout, 5xx, refused connection, cut stream), or whose provider refuses
with a wait (a 429 with `retry-after`), leaves routing until its back-off expires (doubling per
consecutive failure, at least the provider's wait, up to a cap); then it is tried again, and
one success makes it healthy.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from gateway.shadow import CacheModel, Prompt, as_prompt
from gateway.types import ChatRequest, Final, TextDelta

Policy = Literal["prefix", "round_robin"]
Reason = Literal["prefix", "least_loaded", "balance", "round_robin", "retry"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Routing thresholds and health back-off."""

    policy: Policy = "prefix"
    cache_threshold: float = 0.5
    balance_abs: int = 8
    balance_rel: float = 1.5
    retry_after_s: float = 2.0
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.policy not in ("prefix", "round_robin"):
            raise ValueError(f"policy must be 'prefix' or 'round_robin', got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance_abs must be >= 0 and balance_rel >= 1")
        if not 0 < self.retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < retry_after_s <= max_retry_after_s")


class ReplicaBackend(Protocol):
    """What a replica needs from its backend (an `UpstreamBackend` in practice)."""

    replica: str

    def models(self) -> list[str]:
        """Configured model ids."""
        ...

    def stream(self, req: ChatRequest) -> AsyncGenerator[TextDelta | Final, None]:
        """Text deltas, then one Final."""
        ...

    def family_in_body(self, req: ChatRequest) -> bool:
        """Whether the body sent for `req` depends on its prompt family."""
        ...

    def prefill_saved_ms(self, cached_tokens: int) -> float:
        """The prefill time `cached_tokens` cached prompt tokens save on this upstream (ms)."""
        ...

    async def list_models(self) -> list[str]:
        """Configured model ids, else the ones the upstream lists."""
        ...

    async def aclose(self) -> None:
        """Release the backend's resources."""
        ...


@dataclass(eq=False)
class Replica:
    """One upstream replica: its backend, shadow cache, load and health."""

    name: str
    backend: ReplicaBackend
    shadow: CacheModel
    inflight: int = 0
    failures: int = 0
    retry_at: float = 0.0
    served: int = field(default=0)
    reports_figures: bool = False  # its last answer carried its own prompt and cached tokens

    @property
    def healthy(self) -> bool:
        return self.failures == 0

    def routable(self, now: float) -> bool:
        """Healthy, or unhealthy with its back-off over (one more try)."""
        return self.failures == 0 or now >= self.retry_at

    def mark_ok(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def mark_failed(self, config: RouterConfig, now: float | None = None,
                    wait_s: float | None = None) -> None:
        """Out of routing for the back-off (doubling per consecutive failure), or for
        `wait_s`, the wait its provider asked for, when that is longer: either at most
        `max_retry_after_s`."""
        self.failures += 1
        backoff = config.retry_after_s * 2 ** (self.failures - 1)
        delay = min(max(backoff, wait_s or 0.0), config.max_retry_after_s)
        self.retry_at = (time.monotonic() if now is None else now) + delay


class Route(NamedTuple):
    """The chosen replica, the prefix its shadow holds, and why it was chosen."""

    replica: Replica
    matched: int
    reason: Reason


class Router:
    """Chooses a replica per request (see the module docstring for the rule)."""

    def __init__(self, replicas: list[Replica], config: RouterConfig | None = None) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = replicas
        self.config = config or RouterConfig()
        self.clock: Callable[[], float] = time.monotonic  # back-offs' time (tests set theirs)
        self._turn = 0

    def candidates(self, exclude: set[str], now: float | None = None) -> list[Replica]:
        """Replicas to consider: routable ones, else the one whose back-off ends first."""
        now = self.clock() if now is None else now
        pool = [r for r in self.replicas if r.name not in exclude]
        ready = [r for r in pool if r.routable(now)]
        if ready or not pool:
            return ready
        return [min(pool, key=lambda r: r.retry_at)]

    def choose(self, tokens: Prompt | Sequence[int], namespace: str,
               exclude: set[str] | None = None, now: float | None = None) -> Route | None:
        """The replica for a prompt, or None when every replica was excluded. Each replica's
        cache model scores the prompt (what that replica would reuse of it)."""
        pool = self.candidates(exclude or set(), now)
        if not pool:
            return None
        tokens = as_prompt(tokens)
        self._turn += 1
        if self.config.policy == "round_robin":
            replica = pool[self._turn % len(pool)]
            return Route(replica, replica.shadow.match_length(tokens, namespace), "round_robin")
        if not len(tokens):  # nothing to score yet (its tokens come later): no shadow asked
            return self._unscored(pool)
        matches = {r.name: r.shadow.match_length(tokens, namespace) for r in pool}
        if len(pool) > 1 and self._unbalanced(pool):
            least = self._least_loaded(pool)
            return Route(least, matches[least.name], "balance")
        best = max(pool, key=lambda r: (matches[r.name], -r.inflight))
        best_len = matches[best.name]
        if best_len > 0 and best_len >= self.config.cache_threshold * max(len(tokens), 1):
            reason: Reason = "prefix" if best.healthy else "retry"
            return Route(best, best_len, reason)
        least = self._least_loaded(pool)
        return Route(least, matches[least.name], "least_loaded" if least.healthy else "retry")

    def _unscored(self, pool: list[Replica]) -> Route:
        """The route of an empty prompt: what scoring it would choose (every match is 0)."""
        if len(pool) > 1 and self._unbalanced(pool):
            return Route(self._least_loaded(pool), 0, "balance")
        least = pool[0] if len(pool) == 1 else self._least_loaded(pool)
        return Route(least, 0, "least_loaded" if least.healthy else "retry")

    def _unbalanced(self, pool: list[Replica]) -> bool:
        loads = [r.inflight for r in pool]
        high, low = max(loads), min(loads)
        return high - low > self.config.balance_abs and high > self.config.balance_rel * low

    def _least_loaded(self, pool: list[Replica]) -> Replica:
        n = len(pool)
        order = {r.name: (i - self._turn) % n for i, r in enumerate(pool)}
        return min(pool, key=lambda r: (r.inflight, r.shadow.pages, order[r.name]))


def unique_names(names: list[str]) -> list[str]:
    """Replica names, each once: a repeated one gets `#2`, `#3`, ... (two replicas on one
    host and port)."""
    out: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in out:
            n += 1
            candidate = f"{name}#{n}"
        out.append(candidate)
    return out
