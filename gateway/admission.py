"""Admission control: per-tenant rate and concurrency limits, a bounded fair queue.

`Admission.acquire(tenant)` decides before any work is done for a request:
- over the tenant's rate (token bucket, `tenant_rate_per_s` with `tenant_burst`) -> 429 with a
  `retry-after` of the seconds until a token is due;
- over the tenant's concurrency (`tenant_max_concurrency` requests in flight) -> 429;
- all `max_concurrency` slots busy and `max_queue` requests already waiting -> 503;
- otherwise it waits for a slot. Freed slots go to waiting tenants in round-robin order (each
  tenant's own requests first-in first-out), so one tenant's burst cannot starve another's.
The returned `Slot` must be released exactly once (`release()` is idempotent). A waiter that is
cancelled (its client went away) leaves the queue without taking a slot.
`Admission.reading_body(tenant)` counts a request while its body arrives, before `acquire`:
with the tenant's requests in flight it may not pass `tenant_max_concurrency` (429), so one
tenant's slow bodies cannot pile up connections past its limit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

from gateway.errors import GatewayError


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Limits; None means unlimited. Checked in __post_init__."""

    max_concurrency: int = 256
    max_queue: int = 1024
    tenant_max_concurrency: int | None = None
    tenant_rate_per_s: float | None = None
    tenant_burst: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency <= 0 or self.max_queue < 0:
            raise ValueError("max_concurrency must be positive and max_queue >= 0")
        for name in ("tenant_max_concurrency", "tenant_rate_per_s", "tenant_burst"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive when set, got {value}")

    @property
    def burst(self) -> float:
        """Token-bucket size."""
        if self.tenant_burst is not None:
            return float(self.tenant_burst)
        return max(1.0, float(self.tenant_rate_per_s or 1.0))


class Overloaded(GatewayError):
    """A refusal with a `retry-after` (seconds) for the response headers."""

    def __init__(self, status: int, message: str, retry_after: int) -> None:
        kind = "rate_limit_error" if status == 429 else "overloaded_error"
        super().__init__(status, message, kind=kind)
        self.retry_after = retry_after


class _Bucket:
    def __init__(self, burst: float) -> None:
        self.tokens = burst
        self.stamp = time.monotonic()


class Slot:
    """One admitted request's hold on a serving slot."""

    def __init__(self, admission: Admission, tenant: str) -> None:
        self._admission = admission
        self.tenant = tenant
        self._released = False

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        if not self._released:
            self._released = True
            self._admission._release(self.tenant)

_NOTHING: AbstractContextManager[None] = nullcontext()


class Admission:
    """Per-tenant limits and a fair bounded queue in front of the backend (one event loop)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.running = 0
        self.in_flight: dict[str, int] = {}
        self.reading: dict[str, int] = {}  # tenant -> requests whose body is arriving
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._queued = 0
        self._buckets: dict[str, _Bucket] = {}

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return self._queued

    def reading_body(self, tenant: str) -> AbstractContextManager[None]:
        """Count one request of `tenant` while its body arrives, or raise `Overloaded` when
        its requests reading or in flight already reach `tenant_max_concurrency` (with no
        such limit there is nothing to count)."""
        if self.config.tenant_max_concurrency is None:
            return _NOTHING
        return self._reading(tenant)

    @contextmanager
    def _reading(self, tenant: str) -> Iterator[None]:
        self._check_concurrency(tenant, self.reading.get(tenant, 0))
        self.reading[tenant] = self.reading.get(tenant, 0) + 1
        try:
            yield
        finally:
            left = self.reading[tenant] - 1
            if left:
                self.reading[tenant] = left
            else:
                del self.reading[tenant]

    async def acquire(self, tenant: str) -> Slot:
        """Admit one request of `tenant` (waiting for a slot), or raise `Overloaded`."""
        self._check_rate(tenant)
        self._check_concurrency(tenant, 0)
        if self.running < self.config.max_concurrency and not self._queued:
            self._take(tenant)
            return Slot(self, tenant)
        if self._queued >= self.config.max_queue:
            raise Overloaded(503, "the gateway's queue is full; retry later", 1)
        await self._wait(tenant)
        return Slot(self, tenant)

    def _check_concurrency(self, tenant: str, reading: int) -> None:
        limit = self.config.tenant_max_concurrency
        if limit is not None and self.in_flight.get(tenant, 0) + reading >= limit:
            raise Overloaded(429, f"tenant has {limit} requests in flight (the limit)", 1)

    def _check_rate(self, tenant: str) -> None:
        rate = self.config.tenant_rate_per_s
        if rate is None:
            return
        bucket = self._buckets.setdefault(tenant, _Bucket(self.config.burst))
        now = time.monotonic()
        bucket.tokens = min(self.config.burst, bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / rate
            raise Overloaded(429, f"tenant rate limit of {rate:g} requests/s reached",
                             max(1, math.ceil(wait)))
        bucket.tokens -= 1.0

    def _take(self, tenant: str) -> None:
        self.running += 1
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1

    async def _wait(self, tenant: str) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(future)
        self._queued += 1
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1  # counts toward its limit
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self._release(tenant)  # the slot was handed over just as we were cancelled
            else:
                self._forget(tenant, future)
            raise

    def _forget(self, tenant: str, future: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and future in queue:
            queue.remove(future)
            self._queued -= 1
            if not queue:
                del self._waiting[tenant]
        self._dec(tenant)

    def _dec(self, tenant: str) -> None:
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)

    def _release(self, tenant: str) -> None:
        self.running -= 1
        self._dec(tenant)
        self._hand_over()

    def _hand_over(self) -> None:
        """Give free slots to the next waiting tenants, round-robin."""
        while self._waiting and self.running < self.config.max_concurrency:
            tenant, queue = next(iter(self._waiting.items()))
            future = queue.popleft()
            self._queued -= 1
            if queue:
                self._waiting.move_to_end(tenant)  # this tenant goes to the back of the line
            else:
                del self._waiting[tenant]
            if future.done():  # cancelled meanwhile; its _wait cleanup already ran
                continue
            self.running += 1
            future.set_result(None)
