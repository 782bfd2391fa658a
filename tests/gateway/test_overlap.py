"""`first_while_sent`: a backend stream's first item awaited in the caller's own task, the
request's CPU work started in a task of its own once the transport says the request is sent,
and nothing left running when either side fails or the caller is cancelled."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.overlap import first_while_sent
from gateway.types import REQUEST_SENT


class _Upstream:
    """A first() that signals the send, then waits for its answer (`answer`)."""

    def __init__(self, signals: bool = True) -> None:
        self.signals = signals
        self.answer = asyncio.Event()
        self.task: asyncio.Task[object] | None = None
        self.log: list[str] = []

    async def first(self) -> str:
        self.task = asyncio.current_task()
        if self.signals:
            sent = REQUEST_SENT.get()
            assert sent is not None
            sent()
        self.log.append("sent")
        await self.answer.wait()
        self.log.append("answered")
        return "item"


async def test_the_work_runs_while_the_first_item_is_awaited_in_the_callers_task() -> None:
    up = _Upstream()

    async def work() -> int:
        up.log.append("work")
        up.answer.set()  # the answer can only come once the work has run beside first()
        return 7

    caller = asyncio.current_task()
    async with asyncio.timeout(5):
        item, done = await first_while_sent(up.first, work)
    assert (item, done) == ("item", 7)
    assert up.task is caller  # the answer wakes the handler's own task
    assert up.log == ["sent", "work", "answered"]
    assert REQUEST_SENT.get() is None  # the signal is the call's own


async def test_a_backend_that_does_not_signal_gets_its_work_after_the_first_item() -> None:
    up = _Upstream(signals=False)
    up.answer.set()

    async def work() -> str:
        up.log.append("work")
        return "done"

    assert await first_while_sent(up.first, work) == ("item", "done")
    assert up.log == ["sent", "answered", "work"]


async def test_an_outer_signal_still_hears_of_the_send() -> None:
    heard: list[str] = []
    up = _Upstream()
    up.answer.set()

    async def work() -> None:
        return None

    token = REQUEST_SENT.set(lambda: heard.append("outer"))
    try:
        await first_while_sent(up.first, work)
    finally:
        REQUEST_SENT.reset(token)
    assert heard == ["outer"]


async def test_a_failing_upstream_cancels_the_running_work() -> None:
    up = _Upstream()
    ended: list[str] = []

    async def first() -> str:
        sent = REQUEST_SENT.get()
        assert sent is not None
        sent()
        await asyncio.sleep(0.01)  # the work has started and waits
        raise RuntimeError("upstream down")

    async def work() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    with pytest.raises(RuntimeError, match="upstream down"):
        await first_while_sent(first, work)
    assert ended == ["cancelled"]  # cancelled and awaited before the error went on
    assert up.log == []


async def test_failing_work_propagates_once_the_first_item_is_back() -> None:
    up = _Upstream()
    up.answer.set()

    async def work() -> None:
        raise ValueError("lint broke")

    with pytest.raises(ValueError, match="lint broke"):
        await first_while_sent(up.first, work)
    assert up.log == ["sent", "answered"]


async def test_a_cancelled_caller_leaves_no_work_running() -> None:
    up = _Upstream()
    state: list[str] = []

    async def work() -> None:
        state.append("started")
        try:
            await asyncio.sleep(5)
        finally:
            state.append("ended")

    call = asyncio.ensure_future(first_while_sent(up.first, work))
    while not state:
        await asyncio.sleep(0)
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    assert call.cancelled()
    assert state == ["started", "ended"]
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
