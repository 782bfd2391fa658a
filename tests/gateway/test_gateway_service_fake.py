"""Auth and tenants, lint modes, stats records, /metrics and client disconnects (fake backend)."""

from __future__ import annotations

import itertools
import json
import re
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from gateway.api_stats import compute_stats
from gateway.stats import RequestRecord
from tests.support import serve

from .gateway_fakes import FAKE_MODEL, FakeBackend, asgi_client, words_of

CHAT = {"model": FAKE_MODEL, "messages": [
    {"role": "system", "content": "You are the support bot of a shop. Be kind and precise."},
    {"role": "user", "content": "where is my order"}]}
KEYS = {"key-alice": "alice", "key-bob": "bob"}


def records(app) -> list[RequestRecord]:
    app.state.store.flush()
    with app.state.store.session() as session:
        return list(session.scalars(select(RequestRecord).order_by(RequestRecord.id)))


async def test_missing_or_wrong_key_is_401_in_each_format(make_fake_app):
    app = make_fake_app(api_keys=KEYS)
    async with asgi_client(app) as http:
        openai_err = await http.post("/v1/chat/completions", json=CHAT)
        assert openai_err.status_code == 401
        assert openai_err.json()["error"]["type"] == "authentication_error"
        wrong = await http.post("/v1/chat/completions", json=CHAT,
                                headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        anth = await http.post("/v1/messages", json={**CHAT, "max_tokens": 4, "messages": [
            {"role": "user", "content": "x"}]}, headers={"x-api-key": "nope"})
        assert anth.status_code == 401
        assert anth.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "invalid API key"}}
        models = await http.get("/v1/models")
        assert models.status_code == 401
        ok = await http.post("/v1/chat/completions", json=CHAT,
                             headers={"authorization": "Bearer key-alice"})
        assert ok.status_code == 200
    tenants = [(r.tenant, r.status) for r in records(app)]
    assert tenants == [("-", 401), ("-", 401), ("-", 401), ("alice", 200)]


async def test_tenants_and_cache_salt_never_share_cache(make_fake_app, fake_backend):
    app = make_fake_app(api_keys=KEYS)
    clients = {
        name: openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, max_retries=0,
                                 http_client=asgi_client(app))
        for key, name in KEYS.items()
    }
    first = await clients["alice"].chat.completions.create(**CHAT)
    again = await clients["alice"].chat.completions.create(**CHAT)
    other = await clients["bob"].chat.completions.create(**CHAT)
    salted = await clients["alice"].chat.completions.create(**CHAT,
                                                            extra_body={"cache_salt": "s1"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    namespaces = [r.namespace for r in fake_backend.seen]
    assert namespaces == ["alice", "alice", "bob", "alice/s1"]


async def test_admin_key_guards_metrics(make_fake_app):
    app = make_fake_app(api_keys=KEYS, admin_key="root")
    async with asgi_client(app) as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers={"x-api-key": "key-alice"})).status_code == 401
        assert (await http.get("/metrics?key=root")).status_code == 401  # never in a URL
        assert (await http.get("/metrics", headers={"x-api-key": "root"})).status_code == 200
        assert (await http.get("/healthz")).status_code == 200


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_records_and_metrics_match_the_responses(make_fake_app):
    app = make_fake_app(store_prompts=True)
    async with asgi_client(app) as http:
        bodies = [(await http.post("/v1/chat/completions", json=CHAT)).json() for _ in range(3)]
        bad = await http.post("/v1/chat/completions", json={**CHAT, "top_p": 5})
        assert bad.status_code == 400
        text = (await http.get("/metrics")).text
    cached = sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert _metric(text, 'prefixgate_prefix_cache_hits_total{backend="embedded"}') == cached
    assert _metric(text, 'prefixgate_prefix_cache_queries_total{backend="embedded"}') == prompt
    # prometheus_client writes label names sorted.
    ok = 'prefixgate_requests_total{backend="embedded",route="chat.completions",status="200"}'
    assert _metric(text, ok) == 3
    bad_line = ok.replace('"200"', '"400"')
    assert _metric(text, bad_line) == 1
    assert _metric(text, 'prefixgate_request_duration_seconds_count{route="chat.completions"}') == 4
    assert "# TYPE prefixgate_time_to_first_token_seconds histogram" in text
    assert _metric(text, "prefixgate_kv_pages_total") == 1000
    assert _metric(text, "prefixgate_requests_in_flight") == 0
    rows = records(app)
    assert [r.status for r in rows] == [200, 200, 200, 400]
    assert [r.cached_tokens for r in rows[:3]] == [
        b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
    assert all(r.tenant == "default" and r.model == FAKE_MODEL for r in rows)
    assert json.loads(rows[0].prompt_text)["messages"][1]["content"] == "where is my order"
    assert rows[3].error and "top_p" in rows[3].error


async def test_rejected_bodies_record_only_a_served_model(make_fake_app):
    """Every request leaves one record, but a body's `model` is stored only when it names a
    served model: rejected bodies with model 5 or "nope" made stats rows for those models."""
    app = make_fake_app()
    bodies = [{**CHAT, "model": 5}, {**CHAT, "model": "nope"}, {**CHAT, "model": ["x"]},
              {**CHAT, "temperature": "hot"}, CHAT]
    async with asgi_client(app) as http:
        statuses = [(await http.post("/v1/chat/completions", json=b)).status_code
                    for b in bodies]
    assert statuses == [400, 404, 400, 400, 200]
    rows = records(app)
    assert [(r.status, r.model) for r in rows] == [
        (400, ""), (404, ""), (400, ""), (400, FAKE_MODEL), (200, FAKE_MODEL)]
    stats = compute_stats(app.state.store.engine)
    assert [m["model"] for m in stats["by_model"]] == ["-", FAKE_MODEL]  # no "5", no "nope"
    assert stats["totals"]["requests"] == 5


async def test_prompts_are_not_stored_by_default(make_fake_app):
    app = make_fake_app()
    async with asgi_client(app) as http:
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert records(app)[0].prompt_text is None


STAMPED = {"model": FAKE_MODEL, "messages": [
    {"role": "system", "content": "Current time: 2026-11-29T14:03:07Z. You are a shop assistant."},
    {"role": "user", "content": "hello"}]}


async def test_lint_report_and_rewrite_modes(make_fake_app, fake_backend: FakeBackend):
    pytest.importorskip("prompt_lint")
    app = make_fake_app(lint_mode="report")
    async with asgi_client(app) as http:
        report = await http.post("/v1/chat/completions", json=STAMPED)
        assert report.status_code == 200
        ids = report.headers["x-prefixgate-lint"].split(",")
        assert ids and all(i.startswith("PL") for i in ids)
        assert "2026-11-29T14:03:07Z" in fake_backend.seen[-1].messages[0]["content"]
        rewritten = await http.post("/v1/chat/completions", json=STAMPED,
                                    headers={"x-prefixgate-lint-mode": "rewrite"})
        assert rewritten.status_code == 200
        served = fake_backend.seen[-1].messages
        assert "2026-11-29T14:03:07" not in served[0]["content"]
        assert "2026-11-29T14:03:07Z" in served[-1]["content"]  # moved whole, not lost
        off = await http.post("/v1/chat/completions", json=STAMPED,
                              headers={"x-prefixgate-lint-mode": "off"})
        assert off.headers["x-prefixgate-lint"] == ""
        bad = await http.post("/v1/chat/completions", json=STAMPED,
                              headers={"x-prefixgate-lint-mode": "loud"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "x-prefixgate-lint-mode"
    rows = records(app)
    assert rows[0].lint_ids == ",".join(ids)


def test_client_disconnect_mid_stream_aborts_the_request(make_fake_app, fake_backend):
    fake_backend.delay = 0.05
    app = make_fake_app()
    long_text = " ".join(f"w{i}" for i in range(200))
    body = {"model": FAKE_MODEL, "stream": True, "max_tokens": 200,
            "messages": [{"role": "user", "content": long_text}]}
    with serve(app) as server:
        with httpx.Client(base_url=server.url) as http, http.stream(
            "POST", "/v1/chat/completions", json=body
        ) as response:
            assert response.status_code == 200
            head = response.headers
            lines = response.iter_lines()
            # the role chunk, then three deltas of one piece each
            assert sum(line.startswith("data: {") for line in itertools.islice(lines, 8)) == 4
        deadline = time.monotonic() + 10
        while not fake_backend.aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        metrics = httpx.get(server.url + "/metrics").text
    assert len(fake_backend.aborted) == 1 and not fake_backend.finished
    rows = records(app)
    assert [(r.status, r.stream) for r in rows] == [(499, True)]
    _assert_cut_short(rows[0], fake_backend, head, metrics)


def _assert_cut_short(row: RequestRecord, backend: FakeBackend, head: httpx.Headers | None,
                      metrics: str) -> None:
    """A request cut short is recorded with the work done: the prompt and cached tokens its
    head reported (the backend's own prompt count) and the tokens the backend had generated
    when it was aborted, in the record and in the metrics."""
    ((_, generated),) = backend.generated.items()
    assert 3 <= generated < 200
    assert row.completion_tokens == generated and not row.usage_estimated
    assert row.prompt_tokens == len(words_of(backend.seen[-1]))
    if head is not None:
        assert row.prompt_tokens == int(head["x-prefixgate-prompt-tokens"])
        assert row.cached_tokens == int(head["x-prefixgate-cached-tokens"])
    counted = re.search(r'^prefixgate_completion_tokens_total\{[^}]*\} (\S+)$', metrics, re.M)
    assert counted is not None and float(counted.group(1)) == generated


def test_client_gone_during_a_non_streaming_request_aborts_it(make_fake_app, fake_backend):
    fake_backend.delay = 0.05
    app = make_fake_app()
    long_text = " ".join(f"w{i}" for i in range(200))
    body = {"model": FAKE_MODEL, "max_tokens": 200,
            "messages": [{"role": "user", "content": long_text}]}
    with serve(app) as server:
        with httpx.Client(base_url=server.url, timeout=0.5) as http, pytest.raises(
            httpx.ReadTimeout
        ):
            http.post("/v1/chat/completions", json=body)
        deadline = time.monotonic() + 10
        while not fake_backend.aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        metrics = httpx.get(server.url + "/metrics").text
    assert len(fake_backend.aborted) == 1 and not fake_backend.finished
    rows = records(app)
    assert [(r.status, r.stream) for r in rows] == [(499, False)]
    _assert_cut_short(rows[0], fake_backend, None, metrics)


async def test_backend_failure_mid_stream_is_an_sse_error_event(make_fake_app):
    app = make_fake_app()
    body = {"model": FAKE_MODEL, "stream": True,
            "messages": [{"role": "user", "content": "BREAK one two three four"}]}
    async with asgi_client(app) as http:
        response = await http.post("/v1/chat/completions", json=body)
        anth = await http.post("/v1/messages", json={**body, "max_tokens": 9})
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    assert events[1]["choices"][0]["delta"]["content"] == "echo:"
    assert events[-1]["error"]["message"] == "upstream cut the stream"
    assert response.text.endswith("data: [DONE]\n\n")
    assert "event: error" in anth.text and '"type": "error"' in anth.text
    assert [r.status for r in records(app)] == [502, 502]
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none", max_retries=0,
                                http_client=asgi_client(app))
    with pytest.raises(openai.APIError, match="upstream cut the stream"):
        stream = await client.chat.completions.create(**body)
        async for _ in stream:
            pass


async def test_rewrite_on_the_anthropic_route(make_fake_app, fake_backend: FakeBackend):
    pytest.importorskip("prompt_lint")
    app = make_fake_app(lint_mode="rewrite")
    body = {"model": FAKE_MODEL, "max_tokens": 8,
            "system": [{"type": "text", "text": "Today is 2026-11-29 14:03:07. Be brief."}],
            "messages": [{"role": "user", "content": "hello"}]}
    async with asgi_client(app) as http:
        response = await http.post("/v1/messages", json=body)
    assert response.status_code == 200 and response.headers["x-prefixgate-lint"]
    served = fake_backend.seen[-1]
    assert "14:03:07" not in served.messages[0]["content"]
    assert "14:03:07" in served.messages[-1]["content"]
    assert served.body["system"] != body["system"]  # the body a proxy would forward, rewritten
