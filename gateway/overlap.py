"""CPU work a request needs but its upstream call does not: run while the upstream works.

`cpu_work` runs one piece of prompt_lint work (lint, tokenizing for the shadow caches) under
prompt_lint's lock: on the event loop for a body of at most `inline_bytes` while the lock is
free (such work is shorter than a hop to a worker thread), else in a worker thread, so a lock
held elsewhere never blocks the loop.

`first_while_sent` starts a backend stream, runs `work` once the request is on the socket (the
transport calls the `REQUEST_SENT` callback; an outer callback still hears of it) or once the
first item is back (a backend that does not signal), and returns the first item with the work's
result. The work then overlaps the upstream's own time instead of preceding the send.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from gateway.types import REQUEST_SENT
from prompt_lint.memo import LOCK as MEMO_LOCK

T = TypeVar("T")
R = TypeVar("R")


async def cpu_work(size: int, inline_bytes: int, work: Callable[..., R], *args: Any) -> R:
    """`work(*args)` under prompt_lint's lock, inline or in a worker thread (see above)."""
    if size <= inline_bytes and MEMO_LOCK.acquire(blocking=False):
        try:
            return work(*args)
        finally:
            MEMO_LOCK.release()
    return await anyio.to_thread.run_sync(_locked, work, *args)


def _locked(work: Callable[..., R], *args: Any) -> R:
    with MEMO_LOCK:
        return work(*args)


async def first_while_sent(first: Callable[[], Awaitable[T]], work: Callable[[], Awaitable[R]]
                           ) -> tuple[T, R]:
    """`first()` (a stream's first item) and `work()`'s result, the work started once the
    request is sent. On any failure the first item's task is cancelled and awaited before the
    error propagates; the caller closes its stream."""
    sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    outer = REQUEST_SENT.get()

    def signal() -> None:
        if not sent.done():
            sent.set_result(None)
        if outer is not None:
            outer()

    token = REQUEST_SENT.set(signal)
    try:
        task: asyncio.Future[T] = asyncio.ensure_future(first())  # copies the context
    finally:
        REQUEST_SENT.reset(token)
    try:
        await asyncio.wait((task, sent), return_when=asyncio.FIRST_COMPLETED)
        done = await work()
        return await task, done
    except BaseException:
        task.cancel()
        with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
            await task
        raise
    finally:
        sent.cancel()
