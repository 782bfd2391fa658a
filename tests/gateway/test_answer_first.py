"""A whole answer goes out before the shadow cache's part once its replica reports its figures.

Over a one-replica pool whose cache model steers nothing, a non-streaming answer that carries the
provider's own prompt and cached tokens needs no prediction (it reports what the provider
reported), so the shadow's tokens, prediction, recording and learning wait until it is handed
on; the prediction still reaches the request's record (`Final.settled_usage`). The reference is
a shadow cache fed the same tokens by hand, and the answers of a replica that stops reporting.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest

import gateway.backends.pool as pool_module
from gateway.agent_trace import agent_trace
from gateway.backends.predicted_usage import in_upstream_tokens
from gateway.shadow import ShadowCache, request_prompt
from gateway.types import ChatRequest, Final

from .gateway_fakes import asgi_client
from .upstream_helpers import chat_request, fake_replicas, gateway_app, pool_over, records

SALT = "answer-first-test-secret"


def _requests(turns: int) -> list[ChatRequest]:
    trace = agent_trace(sessions=1, turns=turns, seed=7)
    return [chat_request(t.body["messages"], tools=tuple(t.body["tools"]), body=t.body)
            for t in trace]


def _counting_tokens(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(pool_module, "request_prompt",
                        lambda req: calls.append(1) or request_prompt(req))
    return calls


def _not_reporting(app: Any, off: list[bool]) -> Any:
    """`app` whose JSON answers lose `usage.prompt_tokens_details` while `off[0]`."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not off[0]:
            await app(scope, receive, send)
            return
        start: dict[str, Any] = {}

        async def edit(message: Any) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            payload = orjson.loads(message["body"])
            payload["usage"].pop("prompt_tokens_details", None)
            body = orjson.dumps(payload)
            headers = [(k, str(len(body)).encode() if k == b"content-length" else v)
                       for k, v in start["headers"]]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await app(scope, receive, edit)

    return wrapped


async def _first(stream: AsyncGenerator[Any, None]) -> Final:
    item = await anext(stream)
    assert isinstance(item, Final)  # a whole answer: its one item
    return item


async def test_the_answer_is_handed_on_before_the_shadow_tokenizes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_tokens(monkeypatch)
    shadow = ShadowCache()
    pool = pool_over(fake_replicas(1))
    reqs = _requests(3)
    # turn 1: the replica has reported nothing yet, so the prediction comes with the answer
    stream = pool.stream(reqs[0])
    first = await _first(stream)
    assert calls == [1] and first.usage.predicted_cached_tokens == 0
    await stream.aclose()
    pool.router.replicas[0].shadow = shadow  # from here on a shadow the test can read
    shadow.record(request_prompt(reqs[0]), reqs[0].namespace)
    reference = ShadowCache()
    reference.record(request_prompt(reqs[0]), reqs[0].namespace)
    # turn 2: the answer carries the provider's figures and goes out before the tokens
    stream = pool.stream(reqs[1])
    answer = await _first(stream)
    assert calls == [1]
    assert answer.usage.predicted_cached_tokens is None
    assert answer.usage.cached_source == "reported" and not answer.usage.estimated
    assert answer.usage.cached_tokens == answer.usage.reported_cached_tokens > 0
    assert answer.settled_usage() is answer.usage  # nothing completed yet
    await stream.aclose()  # the answer is on its way: the shadow's part runs
    assert calls == [1, 1]
    prompt = request_prompt(reqs[1])
    matched = reference.match_length(prompt, reqs[1].namespace)
    assert matched > 0
    settled = answer.settled_usage()
    assert settled.predicted_cached_tokens == in_upstream_tokens(
        matched, len(prompt), answer.usage.prompt_tokens)
    assert settled.reported_cached_tokens == answer.usage.reported_cached_tokens
    assert settled.cached_tokens == answer.usage.cached_tokens
    # the shadow recorded the prompt as it does before an answer (and learnt from the report)
    reference.record(prompt, reqs[1].namespace)
    later = request_prompt(reqs[2])
    assert shadow.match_length(later, "t") == reference.match_length(later, "t") > matched
    await pool.aclose()


async def test_a_replica_that_stops_reporting_gets_the_prediction_in_its_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_tokens(monkeypatch)
    off = [False]
    pool = pool_over([_not_reporting(fake_replicas(1)[0], off)])
    reqs = _requests(4)
    seen = []
    for i, req in enumerate(reqs):
        off[0] = i == 2
        stream = pool.stream(req)
        answer = await _first(stream)
        seen.append((len(calls), answer.usage.predicted_cached_tokens is None,
                     answer.usage.cached_source))
        await stream.aclose()
    assert seen == [
        (1, False, "reported"),  # nothing known of the replica: tokens while it works
        (1, True, "reported"),  # it reported: the answer first
        (3, False, "predicted"),  # it did not: the answer waits for the prediction
        (4, False, "reported"),  # and the next one is tokenized while the replica works
    ]
    await pool.aclose()


async def test_the_response_reports_the_providers_figures_and_the_record_the_prediction(
        tmp_path: Any) -> None:
    responses, rows, metrics = await _one_session(tmp_path, 3)
    summaries = [r.json()["prefixgate"] for r in responses]
    assert summaries[0]["predicted_cached_tokens"] == 0  # before anything was reported
    for response, summary, row in zip(responses[1:], summaries[1:], rows[1:], strict=True):
        assert summary["predicted_cached_tokens"] is None  # made after the answer went out
        assert summary["cached_tokens_source"] == "reported" and summary["usage"] == "reported"
        assert summary["cached_tokens"] == summary["reported_cached_tokens"] > 0
        assert response.headers["x-prefixgate-cached-tokens"] == str(summary["cached_tokens"])
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            summary["cached_tokens"]
        # the record holds the prediction beside the report, as before
        assert row.cached_tokens == summary["cached_tokens"]
        assert row.predicted_cached_tokens is not None and row.predicted_cached_tokens > 0
    predicted = sum(row.predicted_cached_tokens or 0 for row in rows)
    series = 'prefixgate_upstream_predicted_cached_tokens_total{replica="r0"}'
    assert f"{series} {predicted}" in metrics


async def _one_session(tmp_path: Any, turns: int) -> tuple[list[Any], list[Any], str]:
    """`turns` turns of one agent session through a gateway over one fake replica: the
    responses, the records and /metrics after the last."""
    pool = pool_over(fake_replicas(1))
    app = gateway_app(tmp_path, pool, salt_secret=SALT)
    bodies = [t.body for t in agent_trace(sessions=1, turns=turns, seed=7)]
    async with asgi_client(app) as http:
        responses = [await http.post("/v1/chat/completions", json=b) for b in bodies]
        metrics = (await http.get("/metrics")).text
    rows = records(app)
    app.state.store.close()
    await pool.aclose()
    return responses, rows, metrics


async def test_a_failing_shadow_part_loses_neither_the_answer_nor_its_record(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    calls: list[int] = []

    def broken(req: ChatRequest) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("tokenizer broke")
        return request_prompt(req)

    monkeypatch.setattr(pool_module, "request_prompt", broken)
    responses, rows, _ = await _one_session(tmp_path, 2)
    assert [r.status_code for r in responses] == [200, 200] and len(calls) == 2
    assert [row.status for row in rows] == [200, 200]
    assert rows[1].predicted_cached_tokens is None  # never made: recorded as unknown
    assert rows[1].reported_cached_tokens == responses[1].json()["prefixgate"]["cached_tokens"]
    assert "the shadow cache's part of an answer failed" in caplog.text


def test_report_lint_laid_out_first_leaves_new_messages_for_the_shadow() -> None:
    """Laying a body out first (the answer goes out before the shadow's part), report-mode
    lint estimates a turn's new messages past the provider's minimum instead of tokenizing
    them: its rule ids are those of a lint over exact counts, and the shadow's tokens, made
    from the segments lint left, are the request's exact tokens."""
    from gateway.lint_stage import LintStage
    from gateway.types import LayoutShare
    from prompt_lint.tokens import DEFAULT_ENCODING, shared_counter

    stage, reference = LintStage(), LintStage()
    counter = shared_counter(DEFAULT_ENCODING)
    trace = agent_trace(sessions=1, turns=4, seed=11, system_words=1500)
    estimated = 0
    for i, item in enumerate(trace):
        body = item.body
        last = body["messages"][-1]
        last["content"] = f"{last['content']} (turn {i} of {uuid.uuid4()})"  # never seen
        share = LayoutShare()
        ids = stage.run(body, "openai", "t", "report", share).lint_ids
        layout = share.take(body)
        assert layout is not None
        if layout.exact is not None:
            estimated += 1
            assert counter.known_count(last["content"]) is None  # not tokenized by lint
        assert ids == reference.run(body, "openai", "t", "report").lint_ids
        req = dataclasses.replace(chat_request(body["messages"], tools=tuple(body["tools"]),
                                               body=body), layout_share=share)
        assert request_prompt(req).tokens.data == request_prompt(
            dataclasses.replace(req, layout_share=None)).tokens.data
    assert estimated == len(trace)  # the system prompt alone reaches the minimum


async def test_concurrent_answers_each_get_their_prediction_recorded(tmp_path: Any) -> None:
    """Many requests in flight at once over one replica: every answer is served, every record
    holds a prediction (made in the window or after the answer), and /metrics sums them."""
    import asyncio

    pool = pool_over(fake_replicas(1))
    app = gateway_app(tmp_path, pool, salt_secret=SALT)
    trace = agent_trace(sessions=6, turns=4, seed=13)
    by_session: dict[int, list[Any]] = {}
    for item in trace:
        by_session.setdefault(item.session, []).append(item.body)
    async with asgi_client(app) as http:

        async def session(bodies: list[Any]) -> list[int]:
            return [(await http.post("/v1/chat/completions", json=b)).status_code
                    for b in bodies]

        statuses = await asyncio.gather(*(session(b) for b in by_session.values()))
        metrics = (await http.get("/metrics")).text
    rows = records(app)
    app.state.store.close()
    await pool.aclose()
    assert [s for each in statuses for s in each] == [200] * len(trace)
    assert len(rows) == len(trace)
    assert all(row.predicted_cached_tokens is not None for row in rows)
    assert sum(row.predicted_cached_tokens or 0 for row in rows) > 0
    series = 'prefixgate_upstream_predicted_cached_tokens_total{replica="r0"}'
    assert f"{series} {sum(row.predicted_cached_tokens or 0 for row in rows)}" in metrics
