"""benchmarks.spy_profile: py-spy raw stacks into the request path's parts."""

from __future__ import annotations

import pytest

from benchmarks.spy_profile import busy_stacks, category, shares, top_leaves

ROOT = "thread (1): MainThread;<module> (gateway/cli.py:9);main (gateway/serve.py:80)"
RAW = [
    f"{ROOT};Runner.run (asyncio/runners.py:118) 50",  # the loop waiting: idle
    "thread (2): AnyIO worker thread;WorkerThread.run (anyio/_backends/_asyncio.py:900);"
    "Queue.get (queue.py:171);Condition.wait (threading.py:327) 40",  # idle worker
    "thread (2): AnyIO worker thread;_lint (gateway/pipeline.py:180);"
    "lint_request (prompt_lint/lint.py:40) 30",
    f"{ROOT};ReplicaPool._head (gateway/backends/pool.py:240);"
    "request_prompt (gateway/shadow.py:58);chunks (prompt_lint/tokens.py:57) 5",
    f"{ROOT};handle (gateway/pipeline.py:90);exchange (gateway/backends/upstream_http.py:250);"
    "ClientSession._request (aiohttp/client.py:700) 20",
    f"{ROOT};Starlette.__call__ (starlette/applications.py:90);"
    "RequestResponseCycle.send (uvicorn/protocols/http/httptools_impl.py:524) 10",
    # the request's work runs inside the disconnect guard: it is not the watcher's
    f"{ROOT};handle (gateway/pipeline.py:90);_unless_disconnected (gateway/pipeline.py:120);"
    "_start (gateway/pipeline.py:140);_Connection.send "
    "(gateway/backends/http1_transport.py:123) 8",
    f"{ROOT};_unless_disconnected.<locals>.watch (gateway/pipeline.py:110);"
    "wait_disconnect (gateway/answer.py:137);"
    "RequestResponseCycle.receive (uvicorn/protocols/http/httptools_impl.py:577) 2",
    "not a stack line",
]


def test_idle_samples_and_start_up_frames_are_dropped() -> None:
    stacks = busy_stacks(RAW)
    assert [n for _, n in stacks] == [30, 5, 20, 10, 8, 2]
    assert not any("gateway/cli.py" in s or "gateway/serve.py" in s for s, _ in stacks)


def test_each_stack_goes_to_its_first_matching_part() -> None:
    stacks = busy_stacks(RAW)
    assert [category(s) for s, _ in stacks] == [
        "lint (prompt_lint)", "tokenize for the shadow caches", "upstream HTTP client",
        "Starlette (routing, middleware, response send)", "upstream HTTP client",
        "disconnect watch"]


def test_shares_split_the_cpu_in_proportion() -> None:
    split = shares(busy_stacks(RAW), cpu_ms_per_request=7.5)
    assert [s.category for s in split][0] == "lint (prompt_lint)"
    assert sum(s.fraction for s in split) == pytest.approx(1.0)
    assert sum(s.ms_per_request for s in split) == pytest.approx(7.5)
    assert split[0].ms_per_request == pytest.approx(3.0)
    assert top_leaves(busy_stacks(RAW), 1) == [("lint_request (prompt_lint/lint.py:40)",
                                                pytest.approx(30 / 75))]
