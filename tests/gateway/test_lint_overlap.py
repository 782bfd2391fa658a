"""A request's own CPU work overlaps its upstream call. Report-mode lint runs while the upstream
works: after the request is on the socket, before its answer is awaited; the response and its
record carry the same findings as a lint that ran first. Rewrite mode and an upstream whose body
carries the prompt family (api.openai.com's cache key) still lint before anything is sent. A
one-replica pool tokenizes for its shadow cache while the upstream works too (prefix routing
over several replicas needs the tokens first), and the record is written once the client holds
its answer.

The upstream is a real server (a thread) and the gateway's upstream client its real HTTP/1.1
transport. The lint stage waits (a bounded wait) for the upstream to have received the body:
lint that runs after sending sees it arrive; lint that runs first sees nothing and times out.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway import answer, sse_response
from gateway.agent_trace import agent_trace
from gateway.backends import pool as pool_module
from gateway.backends.pool import ReplicaPool
from gateway.backends.predicted_usage import in_upstream_tokens
from gateway.backends.providers import make_upstream
from gateway.backends.upstream_http import UpstreamOptions
from gateway.lint_stage import LintStage
from gateway.parse_openai import parse_chat
from gateway.shadow import ShadowCache, request_prompt
from gateway.validate import ParseContext
from tests.support import serve

from .gateway_fakes import asgi_client
from .upstream_helpers import fake_replicas, gateway_app, pool_over, records, serving

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


def _counting_layouts(monkeypatch: pytest.MonkeyPatch, lint_layout: str
                      ) -> tuple[list[int], list[int]]:
    """Count the bodies lint lays out (through `gateway.lint_stage`'s `lint_layout`) and the
    ones the shadow's tokens lay out themselves (`gateway.shadow.segments`)."""
    import gateway.lint_stage as lint_stage
    import gateway.shadow as shadow

    by_lint: list[int] = []
    by_shadow: list[int] = []
    own_layout, own_segments = getattr(lint_stage, lint_layout), shadow.segments
    monkeypatch.setattr(lint_stage, lint_layout, lambda *a: by_lint.append(1) or own_layout(*a))
    monkeypatch.setattr(shadow, "segments", lambda *a: by_shadow.append(1) or own_segments(*a))
    return by_lint, by_shadow


async def test_each_request_is_laid_out_once_for_lint_and_the_shadow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over one replica the first request's shadow tokens come first and lint reads their
    layout; once the replica has reported its own figures, a whole answer goes out before
    the shadow's part, so lint lays the body out and the shadow's tokens, after the answer,
    read that. Either way each body is laid out once, and lint finds what a lint of its own
    finds."""
    by_lint, by_shadow = _counting_layouts(monkeypatch, "rule_layout")
    bodies = [t.body for t in agent_trace(sessions=2, turns=3, seed=5)]
    with serving(fake_replicas(1)[0]) as server:
        options = UpstreamOptions(url=f"{server.url}/v1", name="r0")
        app = gateway_app(tmp_path, ReplicaPool("openai", [make_upstream("openai", options)]),
                          salt_secret=SALT)
        async with asgi_client(app) as http:
            found = [(await http.post("/v1/chat/completions", json=body, headers={
                "x-prefixgate-lint-mode": "report"})).headers["x-prefixgate-lint"]
                for body in bodies]
        rows = records(app)
        app.state.store.close()
        await app.state.backend.aclose()
    assert len(by_shadow) == 1 and len(by_lint) == len(bodies) - 1
    assert all(row.predicted_cached_tokens is not None for row in rows)
    reference = LintStage()
    expected = [reference.run(body, "openai", "default", "report") for body in bodies]
    assert found == [",".join(e.lint_ids) for e in expected]
    assert [row.family for row in rows] == [e.family for e in expected]
    assert any(found)


async def test_lint_before_the_send_lays_the_body_out_for_the_route_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite mode lints before the request is sent, and prefix routing over two replicas
    needs the tokens before it too: lint lays the body out once and the shadow's tokens read
    that (a body the rewrite changed is laid out again, for what is sent)."""
    by_lint, by_shadow = _counting_layouts(monkeypatch, "token_layout")
    bodies = [t.body for t in agent_trace(sessions=2, turns=3, seed=5)]
    for body in bodies[1::2]:  # every other request's tools out of order: rewrite sorts them
        body["tools"] = body["tools"][::-1]
    changed = []
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serving(app)).url for app in fake_replicas(2)]
        backends = [make_upstream("openai", UpstreamOptions(url=f"{url}/v1", name=f"r{i}"))
                    for i, url in enumerate(urls)]
        app = gateway_app(tmp_path, ReplicaPool("openai", backends), salt_secret=SALT)
        async with asgi_client(app) as http:
            for body in bodies:
                before = len(by_shadow)
                r = await http.post("/v1/chat/completions", json=body,
                                    headers={"x-prefixgate-lint-mode": "rewrite"})
                assert r.status_code == 200
                changed.append(len(by_shadow) - before)
        rows = records(app)
        app.state.store.close()
        await app.state.backend.aclose()
    assert len(by_lint) == len(bodies)  # lint laid every body out
    reference = LintStage()
    rewritten = [reference.run(b, "openai", "default", "rewrite").changed for b in bodies]
    assert changed == [1 if c else 0 for c in rewritten]  # only a rewritten body again
    assert any(rewritten) and not all(rewritten)
    assert all(row.predicted_cached_tokens is not None for row in rows)


@pytest.mark.parametrize(("mode", "derive_key"), [("rewrite", None), ("report", True)])
async def test_lint_that_shapes_the_body_runs_before_it_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
        derive_key: bool | None) -> None:
    seen, r, rows = await _one_request(tmp_path, monkeypatch, mode, derive_key, 0.5)
    assert seen == [False]  # nothing had been sent while lint ran
    assert r.status_code == 200 and r.headers["x-prefixgate-lint"]
    assert rows[0].lint_ids == r.headers["x-prefixgate-lint"]


# ---------------------------------------------------------------- tokens while the upstream works


def _waiting_tokens(monkeypatch: pytest.MonkeyPatch, arrived: threading.Event,
                    wait_s: float) -> list[bool]:
    """Make the pool's tokenizing first wait up to `wait_s` for the upstream to hold the body;
    returns whether it did, per call (whichever path, early or late, tokenizes)."""
    seen: list[bool] = []

    def tokens(req: Any) -> Any:
        seen.append(arrived.wait(wait_s))
        return request_prompt(req)

    monkeypatch.setattr(pool_module, "request_prompt", tokens)
    return seen


async def _session(tmp_path: Path, apps: list[Any], arrived: threading.Event, turns: int
                   ) -> tuple[list[Any], list[Any]]:
    """`turns` turns of one agent session through a gateway over real servers for `apps`
    (lint off); the responses and the records."""
    bodies = [t.body for t in agent_trace(sessions=1, turns=turns, seed=5)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serving(_noting_arrival(app, arrived))).url for app in apps]
        backends = [make_upstream("openai", UpstreamOptions(url=f"{url}/v1", name=f"r{i}"))
                    for i, url in enumerate(urls)]
        app = gateway_app(tmp_path, ReplicaPool("openai", backends), salt_secret=SALT)
        out = []
        async with asgi_client(app) as http:
            for body in bodies:
                arrived.clear()
                out.append(await http.post("/v1/chat/completions", json=body))
        rows = records(app)
        app.state.store.close()
        await app.state.backend.aclose()
    return out, rows


async def test_one_replica_pool_tokenizes_once_the_upstream_holds_the_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrived = threading.Event()
    seen = _waiting_tokens(monkeypatch, arrived, 10.0)
    responses, rows = await _session(tmp_path, fake_replicas(1), arrived, 2)
    assert seen == [True, True]  # both requests were on the socket before tokenizing began
    assert [r.status_code for r in responses] == [200, 200]
    # the prediction is the one a shadow cache computes from the same tokens, in the
    # upstream's units (the first turn's prompt recorded, the second's prefix matched)
    bodies = [t.body for t in agent_trace(sessions=1, turns=2, seed=5)]
    ctx = ParseContext("ref", "default", ("*",))
    prompts = [request_prompt(parse_chat(b, ctx)) for b in bodies]
    shadow = ShadowCache()
    shadow.record(prompts[0], rows[0].tenant)
    matched = shadow.match_length(prompts[1], rows[0].tenant)
    assert matched > 0
    expected = in_upstream_tokens(matched, len(prompts[1]), rows[1].prompt_tokens)
    assert rows[1].predicted_cached_tokens == expected
    assert rows[1].reported_cached_tokens and rows[1].reported_cached_tokens > 0
    assert responses[1].headers["x-prefixgate-cached-tokens"] == str(rows[1].cached_tokens)


async def test_prefix_routing_tokenizes_before_choosing_a_replica(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrived = threading.Event()
    seen = _waiting_tokens(monkeypatch, arrived, 0.3)
    responses, rows = await _session(tmp_path, fake_replicas(2), arrived, 1)
    assert seen == [False]  # the route needs the tokens: nothing was sent yet
    assert responses[0].status_code == 200 and len(rows) == 1


# ---------------------------------------------------------------- bookkeeping after the answer


@pytest.mark.parametrize("stream", [False, True])
def test_the_record_is_written_after_the_client_has_the_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """The record waits (bounded) for the client to hold the whole response (a stream: up to
    its last byte): written first, the response could not end until the wait gave up."""
    answered = threading.Event()
    waited: list[bool] = []
    module = sse_response if stream else answer
    original = module.record

    def record(*args: Any, **kwargs: Any) -> None:
        waited.append(answered.wait(10.0))
        original(*args, **kwargs)

    monkeypatch.setattr(module, "record", record)
    body = {**agent_trace(sessions=1, turns=1, seed=5)[0].body, "stream": stream}
    app = gateway_app(tmp_path, pool_over(fake_replicas(1)), salt_secret=SALT)
    with serve(app) as gateway, httpx.Client(timeout=30.0) as client:
        with client.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as r:
            text = r.read().decode()
        answered.set()
        deadline = time.monotonic() + 10.0
        while not records(app) and time.monotonic() < deadline:
            time.sleep(0.02)
        rows = records(app)
    assert r.status_code == 200
    assert waited == [True]
    assert len(rows) == 1 and rows[0].status == 200
    if stream:
        assert text.rstrip().endswith("data: [DONE]")
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        summary = next(e["prefixgate"] for e in reversed(events) if "prefixgate" in e)
        assert rows[0].prompt_tokens == summary["prompt_tokens"]
    else:
        assert rows[0].prompt_tokens == json.loads(text)["usage"]["prompt_tokens"]
