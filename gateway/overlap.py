"""CPU work a request needs but its upstream call does not: run while the upstream works.

`cpu_work` runs one piece of prompt_lint work (lint, tokenizing for the shadow caches) under
prompt_lint's lock: on the event loop for a body of at most `inline_bytes` while the lock is
free (such work is shorter than a hop to a worker thread), else in a worker thread, so a lock
held elsewhere never blocks the loop.

`first_while_sent` waits for a backend stream's first item in the caller's task and starts
`work` in a task of its own once the request is on the socket (the transport calls the
`REQUEST_SENT` callback; an outer callback still hears of it), or runs it once the first item is
back (a backend that does not signal); it returns the first item with the work's result. The
work then overlaps the upstream's own time instead of preceding the send, and the answer wakes
the handler's own task.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Coroutine
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


async def first_while_sent(first: Callable[[], Awaitable[T]],
                           work: Callable[[], Coroutine[Any, Any, R]]) -> tuple[T, R]:
    """`first()` (a stream's first item) and `work()`'s result, the work started once the
    request is sent. `first()` runs in the caller's own task, so the answer wakes the handler
    itself (no task of its own to finish first); the work runs in a task started by the
    transport's signal, in the caller's context. On any failure the work's task is cancelled
    and awaited before the error propagates; the caller closes its stream."""
    context = contextvars.copy_context()
    outer = REQUEST_SENT.get()
    started: list[asyncio.Task[R]] = []

    def signal() -> None:
        if not started:
            started.append(asyncio.get_running_loop().create_task(work(), context=context))
        if outer is not None:
            outer()

    token = REQUEST_SENT.set(signal)
    try:
        item = await first()
    except BaseException:
        if started:
            await _cancelled(started[0])
        raise
    finally:
        REQUEST_SENT.reset(token)
    if not started:  # a backend that does not signal: the work follows its first item
        return item, await work()
    try:
        return item, await started[0]
    except BaseException:
        await _cancelled(started[0])
        raise


async def _cancelled(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait for it to end, whatever it raises (shielded: the caller is
    failing already, perhaps by its own cancellation)."""
    task.cancel()
    with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
        await task
