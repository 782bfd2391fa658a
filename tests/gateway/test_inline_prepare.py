"""A small body's lint and tokenizing run on the event loop (no worker-thread hop): the same
answers, headers, records and upstream bodies as the worker-thread path, and never a loop
blocked on prompt_lint's lock."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from gateway.agent_trace import agent_trace
from prompt_lint.memo import LOCK as MEMO_LOCK

from .gateway_fakes import asgi_client
from .upstream_helpers import fake_replicas, gateway_app, pool_over, records

SALT = "s" * 32
LINT_REPORT = {"x-prefixgate-lint-mode": "report"}
VOLATILE_RECORD = {"id", "ts", "request_id", "latency_ms", "ttft_ms", "tpot_ms"}


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the functions sent to a worker thread while the test runs (the work a
    lock-taking wrapper runs is named by itself)."""
    names: list[str] = []
    original = anyio.to_thread.run_sync

    async def counting(func: Any, *args: Any, **kwargs: Any) -> Any:
        named = args[0] if args and callable(args[0]) else func
        names.append(getattr(named, "__name__", repr(func)))
        return await original(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    yield names


async def _serve_trace(tmp_path: Path, inline_bytes: int) -> dict[str, Any]:
    """A 2-session agent trace through a fresh gateway over two fake replicas."""
    apps = fake_replicas(2)
    app = gateway_app(tmp_path, pool_over(apps), inline_prepare_bytes=inline_bytes,
                      salt_secret=SALT)
    answers = []
    async with asgi_client(app) as http:
        for item in agent_trace(sessions=2, turns=4, seed=3):
            r = await http.post("/v1/chat/completions", json=item.body, headers=LINT_REPORT)
            body = r.json()
            answers.append((r.status_code, {k: v for k, v in body.items()
                                            if k not in ("id", "created")},
                            {k: v for k, v in r.headers.items()
                             if k.startswith("x-prefixgate-")}))
    rows = [{k: v for k, v in vars(row).items() if k not in VOLATILE_RECORD
             and not k.startswith("_")} for row in records(app)]
    app.state.store.close()
    upstream = [a.state.replica.config.bodies for a in apps]
    return {"answers": answers, "records": rows, "upstream": upstream}


async def test_inline_path_serves_and_records_what_the_thread_path_does(
        tmp_path: Path, hops: list[str]) -> None:
    threaded = await _serve_trace(tmp_path / "threaded", 0)
    # report mode: tokenizing before the request is sent, lint after (two hops each)
    assert hops.count("_prepare_only") == 8 and hops.count("_lint") == 8
    hops.clear()
    inline = await _serve_trace(tmp_path / "inline", 64 << 10)
    assert not {"_prepare_only", "_lint"} & set(hops)  # every body was small enough
    assert inline == threaded
    assert all(status == 200 for status, _, _ in inline["answers"])
    assert any(h["x-prefixgate-lint"] for _, _, h in inline["answers"])  # lint really ran
    assert all(b.get("cache_salt") for bodies in inline["upstream"] for b in bodies)


async def test_a_held_lint_lock_sends_the_request_to_a_worker_thread(
        tmp_path: Path, hops: list[str]) -> None:
    app = gateway_app(tmp_path, pool_over(fake_replicas(1)), salt_secret=SALT)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with MEMO_LOCK:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    body = agent_trace(sessions=1, turns=1)[0].body
    async with asgi_client(app) as http:
        request = asyncio.ensure_future(http.post("/v1/chat/completions", json=body,
                                                  headers=LINT_REPORT))
        for _ in range(20):  # the loop keeps running while the worker waits for the lock
            await asyncio.sleep(0.01)
        assert not request.done()
        release.set()
        r = await request
    thread.join()
    assert r.status_code == 200 and hops.count("_prepare_only") == 1
    assert [row.status for row in records(app)] == [200]
    app.state.store.close()
