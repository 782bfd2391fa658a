"""The operator's surfaces agree with what the clients were told: /api/stats (the dashboard's
and `prefixgate stats`' numbers) and /metrics against the `prefixgate` summaries of the
responses, over requests that ended every way (answered, cut by the upstream, left by the
client). References: the summaries the official openai SDK received, and the one replica that
served every request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from gateway.api_stats import compute_stats

from .test_upstream_anthropic import FakeAnthropic
from .upstream_helpers import (
    fake_replicas,
    gateway_app,
    pool_over,
    pool_over_handler,
    records,
    serving,
    slow_words,
)

SYSTEM = "You are a careful coding agent. Follow the repository conventions. " * 40


def _sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="none", http_client=http,
                              max_retries=0)


def _metric(text: str, series: str) -> float:
    """One sample of the Prometheus text, 0 when the series has none yet."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _streamed_summary(client: openai.AsyncOpenAI, messages: list[dict[str, Any]]
                            ) -> dict[str, Any] | None:
    """The `prefixgate` summary of one streamed answer; None when the stream failed mid-way."""
    stream = await client.chat.completions.create(
        model="fake", messages=messages, stream=True, stream_options={"include_usage": True})
    summary = None
    try:
        async for chunk in stream:
            summary = (chunk.model_extra or {}).get("prefixgate", summary)
    except openai.APIError:
        return None
    return summary


def _settled_records(app: Any, count: int) -> list[Any]:
    """The app's records once `count` are written (a stream's record follows its last byte)."""
    deadline = time.monotonic() + 10
    while len(rows := records(app)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return rows


async def test_predicted_and_reported_hits_are_compared_over_the_same_requests(
        tmp_path: Path) -> None:
    """A stream the upstream cuts has the shadow's prediction (its head) but no report: the
    predicted-vs-reported totals of /api/stats and /metrics leave it out of both sides, so
    they equal the summaries of the answered requests (the cut one predicted a hit too)."""
    [replica] = fake_replicas(1)
    app = gateway_app(tmp_path, pool_over([replica]))
    client = _sdk(app)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    summaries = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"step {turn}: run the tests"})
        summary = await _streamed_summary(client, messages)
        assert summary is not None
        summaries.append(summary)
        messages.append({"role": "assistant", "content": "Done. The next step is ready."})
    replica.state.replica.config.cut_after = 2  # the next stream ends without its usage
    messages.append({"role": "user", "content": "step 3: run the tests"})
    assert await _streamed_summary(client, messages) is None
    rows = _settled_records(app, 4)
    assert [r.status for r in rows] == [200, 200, 200, 502]
    assert rows[-1].predicted_cached_tokens and rows[-1].reported_cached_tokens is None
    predicted = sum(s["predicted_cached_tokens"] for s in summaries)
    reported = sum(s["reported_cached_tokens"] for s in summaries)
    assert predicted > 0 and reported > 0

    stats = compute_stats(app.state.store.engine)
    [by_replica] = stats["by_replica"]
    for group in (stats["totals"], by_replica):
        assert (group["predicted_cached_tokens"], group["reported_cached_tokens"]) == \
            (predicted, reported)
    metrics = (await client._client.get("http://gw/metrics")).text
    assert _metric(metrics, 'prefixgate_upstream_predicted_cached_tokens_total{replica="r0"}') \
        == predicted
    assert _metric(metrics, 'prefixgate_upstream_reported_cached_tokens_total{replica="r0"}') \
        == reported
    app.state.store.close()


async def test_a_stream_failing_after_its_report_is_left_out_of_the_comparison(
        tmp_path: Path) -> None:
    """Anthropic reports a stream's cached tokens in message_start, before the answer: a
    stream that fails after it has a report and a prediction, but no answer. /metrics counts
    answered requests; /api/stats compares over the same answered requests, not also the
    failed one (the two surfaces said different totals for one run)."""
    fake = FakeAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    body = {"model": "c", "max_tokens": 9, "stream": True, "system": SYSTEM * 3,
            "messages": [{"role": "user", "content": "ship the release"}]}
    summaries = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        for _ in range(2):
            events = (await http.post("/v1/messages", json=body)).text.split("\n\n")
            delta = next(e for e in events if e.startswith("event: message_delta"))
            summaries.append(json.loads(delta.split("data: ", 1)[1])["prefixgate"])
        fake.fail_mid_stream = True
        assert "event: error" in (await http.post("/v1/messages", json=body)).text
        metrics = (await http.get("/metrics")).text
    rows = _settled_records(app, 3)
    assert [r.status for r in rows] == [200, 200, 529]  # the provider's mid-stream overload
    assert rows[-1].reported_cached_tokens and rows[-1].predicted_cached_tokens is not None
    predicted = sum(s["predicted_cached_tokens"] for s in summaries)
    reported = sum(s["reported_cached_tokens"] for s in summaries)
    assert predicted > 0 and reported > 0
    totals = compute_stats(app.state.store.engine)["totals"]
    assert (totals["predicted_cached_tokens"], totals["reported_cached_tokens"]) == \
        (predicted, reported)
    assert _metric(metrics, 'prefixgate_upstream_predicted_cached_tokens_total{replica="up"}') \
        == predicted
    assert _metric(metrics, 'prefixgate_upstream_reported_cached_tokens_total{replica="up"}') \
        == reported
    app.state.store.close()
    await pool.aclose()


async def test_hits_an_upstream_never_reports_are_not_compared(tmp_path: Path) -> None:
    """An upstream that reports no cached tokens (its usage has no cache field) gives the
    shadow nothing to be compared with: the predicted-vs-reported totals stay 0 on both
    surfaces rather than counting the prediction against a report of 0."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 700, "completion_tokens": 1, "total_tokens": 701}})

    app = gateway_app(tmp_path, pool_over_handler(handler))
    client = _sdk(app)
    body = {"model": "m", "messages": [{"role": "user", "content": "plan the change " * 150}]}
    summaries = [(await client.chat.completions.create(**body)).model_extra["prefixgate"]
                 for _ in range(2)]
    assert summaries[1]["predicted_cached_tokens"] > 0  # the shadow expects a hit
    assert all(s["reported_cached_tokens"] is None for s in summaries)
    rows = records(app)
    assert len(rows) == 2
    totals = compute_stats(app.state.store.engine)["totals"]
    assert (totals["predicted_cached_tokens"], totals["reported_cached_tokens"]) == (0, 0)
    metrics = (await client._client.get("http://gw/metrics")).text
    assert _metric(metrics, 'prefixgate_upstream_predicted_cached_tokens_total{replica="up"}') \
        == 0
    app.state.store.close()


def test_a_stream_the_client_leaves_is_filed_under_its_replica(tmp_path: Path) -> None:
    """A client that leaves an upstream stream mid-way: its record names the replica that
    served the head (the only one), so /api/stats' per-replica table holds its tokens rather
    than a '-' row of work no replica did."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=slow_words(),
                              headers={"content-type": "text/event-stream"})

    app = gateway_app(tmp_path, pool_over_handler(handler))
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go " * 80}]}
    with serving(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            head = response.headers
            list(itertools.islice(response.iter_lines(), 6))
        (row,) = _settled_records(app, 1)
    assert row.status == 499 and row.prompt_tokens == int(head["x-prefixgate-prompt-tokens"])
    assert row.replica == "up"
    [by_replica] = compute_stats(app.state.store.engine)["by_replica"]
    assert (by_replica["replica"], by_replica["prompt_tokens"]) == ("up", row.prompt_tokens)
    app.state.store.close()


def test_every_upstream_call_has_an_outcome_in_the_metrics(tmp_path: Path) -> None:
    """`prefixgate_upstream_requests_total` by outcome adds up to the calls the replica took:
    an answered one is "ok", a stream its client left mid-way "cancelled" (it was counted
    nowhere, so a replica looked to have served fewer requests than /api/stats showed)."""
    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, content=slow_words(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 90, "completion_tokens": 1, "total_tokens": 91,
                      "prompt_tokens_details": {"cached_tokens": 0}}})

    app = gateway_app(tmp_path, pool_over_handler(handler))
    body = {"model": "m", "messages": [{"role": "user", "content": "go " * 80}]}
    with serving(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as cut:
            list(itertools.islice(cut.iter_lines(), 6))
        rows = _settled_records(app, 2)
        metrics = http.get("/metrics").text
    assert [r.status for r in rows] == [200, 499]
    outcomes = {outcome: _metric(metrics, 'prefixgate_upstream_requests_total'
                                          f'{{outcome="{outcome}",replica="up"}}')
                for outcome in ("ok", "cancelled")}
    assert outcomes == {"ok": 1, "cancelled": 1}
    assert metrics.count("prefixgate_upstream_requests_total{") == 2  # no other outcome
    app.state.store.close()


def test_a_request_the_client_leaves_before_the_answer_is_filed_under_its_replica(
        tmp_path: Path) -> None:
    """A client that gives up on a whole answer while the upstream still works: the record
    names the replica the request went to (it has no answer and no error to name it), as the
    replica's "cancelled" call in /metrics does, so the two count the same calls."""
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3)
        return httpx.Response(200, json={"id": "c1", "object": "chat.completion",
                                         "created": 0, "model": "m", "choices": []})

    app = gateway_app(tmp_path, pool_over_handler(handler))
    body = {"model": "m", "messages": [{"role": "user", "content": "go " * 80}]}
    with serving(app) as server:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
        (row,) = _settled_records(app, 1)
        metrics = httpx.get(server.url + "/metrics").text
    assert (row.status, row.replica) == (499, "up")
    assert _metric(metrics, 'prefixgate_upstream_requests_total{outcome="cancelled",'
                            'replica="up"}') == 1
    app.state.store.close()


async def test_a_stream_head_through_llama_server_claims_the_prefill_its_hit_saves(
        tmp_path: Path) -> None:
    """Through a llama.cpp server a hit saves the server's own prefill time per token (the
    fake's 0.5 ms): a stream's head, which carries the predicted hit, says that hit's saving
    too (it said 0.0 ms beside hundreds of cached tokens), as the record of a stream cut
    after its head keeps it; the final summary says the reported hit's."""
    from gateway.fake_llama_server import FakeLlamaConfig, create_fake_llama_server

    server = create_fake_llama_server(FakeLlamaConfig(slots=1, prompt_ms_per_token=0.5))
    app = gateway_app(tmp_path, pool_over([server], kind="llamacpp"))
    client = _sdk(app)
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    heads = []
    for turn in range(3):
        history.append({"role": "user", "content": f"step {turn}: run the tests"})
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=history, stream=True)
        chunks = [c async for c in raw.parse()]
        heads.append((int(raw.headers["x-prefixgate-cached-tokens"]),
                      float(raw.headers["x-prefixgate-prefill-saved-ms"])))
        history.append({"role": "assistant", "content": "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices)})
    assert heads[0] == (0, 0.0)  # nothing cached, nothing timed yet
    assert all(cached > 0 for cached, _ in heads[1:])
    assert [ms for _, ms in heads[1:]] == [round(0.5 * cached, 1) for cached, _ in heads[1:]]
    app.state.store.close()
