"""The model ids an upstream pool lists at `GET /v1/models`, asked of its replicas at most once
every `LISTING_TTL_S` seconds.

Every `GET /v1/models` used to ask every replica in turn (each up to 5 s when one did not
answer), so a client polling the route, or a flood of it, became as many requests to each
provider. Now concurrent callers share one listing in progress, the replicas are asked at once,
and the answer is kept for a few seconds (a server's model list changes on a restart, not
between two requests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

LISTING_TTL_S = 10.0

Lister = Callable[[], Awaitable[list[str]]]


class ModelListing:
    """The union of what `listers` return, in their order, each id once; refreshed once it is
    `ttl_s` old."""

    def __init__(self, listers: Sequence[Lister], ttl_s: float = LISTING_TTL_S) -> None:
        self.listers = tuple(listers)
        self.ttl_s = ttl_s
        self._listing: asyncio.Future[list[str]] | None = None
        self._since = 0.0

    async def ids(self) -> list[str]:
        """The current listing (shared with every caller while it is fetched: one caller
        going away does not cancel it for the others)."""
        now = time.monotonic()
        if self._listing is None or now - self._since > self.ttl_s:
            self._listing = asyncio.ensure_future(self._fetch())
            self._since = now
        return list(await asyncio.shield(self._listing))

    async def _fetch(self) -> list[str]:
        lists = await asyncio.gather(*(lister() for lister in self.listers))
        return list(dict.fromkeys(model for ids in lists for model in ids))
