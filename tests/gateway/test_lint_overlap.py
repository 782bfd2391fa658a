"""Report-mode lint runs while the upstream works: after the request is on the socket, before
its answer is awaited; the response and its record carry the same findings as a lint that ran
first. Rewrite mode and an upstream whose body carries the prompt family (api.openai.com's
cache key) still lint before anything is sent.

The upstream is a real server (a thread) and the gateway's upstream client its real aiohttp
transport. The lint stage waits (a bounded wait) for the upstream to have received the body:
lint that runs after sending sees it arrive; lint that runs first sees nothing and times out.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from gateway.agent_trace import agent_trace
from gateway.backends.pool import ReplicaPool, make_upstream
from gateway.backends.upstream_http import UpstreamOptions
from gateway.lint_stage import LintStage

from .gateway_fakes import asgi_client
from .upstream_helpers import fake_replicas, gateway_app, records, serving

SALT = "s" * 32


def _noting_arrival(app: Any, arrived: threading.Event) -> Any:
    """`app`, setting `arrived` once a request's whole body has been received."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        arrived.set()
        body = b"".join(chunks)
        done = False

        async def replay() -> dict[str, Any]:
            nonlocal done
            if done:
                return {"type": "http.disconnect"}
            done = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await app(scope, replay, send)

    return wrapped


def _waiting_lint(monkeypatch: pytest.MonkeyPatch, arrived: threading.Event,
                  wait_s: float) -> list[bool]:
    """Make every lint first wait up to `wait_s` for the upstream to hold the body; returns
    whether it did, per lint call."""
    seen: list[bool] = []
    original = LintStage.run

    def run(self: LintStage, *args: Any, **kwargs: Any) -> Any:
        if args[-1] != "off":
            seen.append(arrived.wait(wait_s))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LintStage, "run", run)
    return seen


async def _one_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
                       derive_key: bool | None, wait_s: float
                       ) -> tuple[list[bool], Any, list[Any]]:
    arrived = threading.Event()
    seen = _waiting_lint(monkeypatch, arrived, wait_s)
    body = agent_trace(sessions=1, turns=1, seed=5)[0].body
    with serving(_noting_arrival(fake_replicas(1)[0], arrived)) as server:
        options = UpstreamOptions(url=f"{server.url}/v1", name="r0",
                                  derive_prompt_cache_key=derive_key)
        app = gateway_app(tmp_path, ReplicaPool("openai", [make_upstream("openai", options)]),
                          salt_secret=SALT)
        async with asgi_client(app) as http:
            r = await http.post("/v1/chat/completions", json=body,
                                headers={"x-prefixgate-lint-mode": mode})
        rows = records(app)
        app.state.store.close()
        await app.state.backend.aclose()
    return seen, r, rows


async def test_report_lint_runs_once_the_upstream_holds_the_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen, r, rows = await _one_request(tmp_path, monkeypatch, "report", None, 10.0)
    assert seen == [True]  # the upstream had the whole body before lint began
    assert r.status_code == 200
    # the same findings as linting the body on its own, on the response and its record
    body = agent_trace(sessions=1, turns=1, seed=5)[0].body
    expected = LintStage().run(body, "openai", "default", "report").lint_ids
    assert expected  # the trace's prompt has something to report (a timestamp at its top)
    assert r.headers["x-prefixgate-lint"] == ",".join(expected)
    assert [row.lint_ids for row in rows] == [",".join(expected)]
    assert rows[0].family is not None


@pytest.mark.parametrize(("mode", "derive_key"), [("rewrite", None), ("report", True)])
async def test_lint_that_shapes_the_body_runs_before_it_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
        derive_key: bool | None) -> None:
    seen, r, rows = await _one_request(tmp_path, monkeypatch, mode, derive_key, 0.5)
    assert seen == [False]  # nothing had been sent while lint ran
    assert r.status_code == 200 and r.headers["x-prefixgate-lint"]
    assert rows[0].lint_ids == r.headers["x-prefixgate-lint"]
