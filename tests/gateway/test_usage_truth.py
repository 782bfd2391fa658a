"""Every response tells the truth about its usage: headers, final usage and `prefixgate` field.

References: the caching fake upstream (its own radix cache over its own tokenization reports
the hits; `gateway.fake_upstream`), and an upstream that sends no usage at all. The official
openai and anthropic SDKs are the clients.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai

from gateway.agent_trace import agent_trace
from prompt_lint.tokens import get_encoding

from .upstream_helpers import (
    fake_replicas,
    gateway_app,
    pool_over,
    pool_over_handler,
    records,
    serving,
    slow_words,
)


def _sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="none", http_client=http,
                              max_retries=0)


def _agree(headers: Any, summary: dict[str, Any], prompt: int, cached: int) -> None:
    """The final figures equal the usage, in the headers (when final) and the summary."""
    assert (summary["prompt_tokens"], summary["cached_tokens"]) == (prompt, cached)
    assert summary["cached_tokens_source"] == "reported" and summary["usage"] == "reported"


async def test_upstream_headers_and_summary_equal_usage_on_every_response(tmp_path: Path) -> None:
    app = gateway_app(tmp_path, pool_over(fake_replicas(2)))
    client = _sdk(app)
    trace = agent_trace(sessions=3, turns=3, system_words=300, task_words=80, output_words=40)
    for i, item in enumerate(trace):
        body = {"model": "fake", "messages": item.body["messages"], "tools": item.body["tools"]}
        if i % 3 == 0:  # non-streaming: the headers carry the reported figures
            raw = await client.chat.completions.with_raw_response.create(**body)
            out = raw.parse()
            cached = out.usage.prompt_tokens_details.cached_tokens
            assert int(raw.headers["x-prefixgate-cached-tokens"]) == cached
            assert int(raw.headers["x-prefixgate-prompt-tokens"]) == out.usage.prompt_tokens
            assert raw.headers["x-prefixgate-cached-tokens-source"] == "reported"
            assert raw.headers["x-prefixgate-usage"] == "reported"
            _agree(raw.headers, out.model_extra["prefixgate"], out.usage.prompt_tokens, cached)
            continue
        include = i % 3 == 1
        extra = {"stream_options": {"include_usage": True}} if include else {}
        raw = await client.chat.completions.with_raw_response.create(stream=True, **body, **extra)
        # the head went out before the upstream reported: its figure is the shadow's, and says so
        assert raw.headers["x-prefixgate-cached-tokens-source"] == "predicted"
        chunks = [c async for c in raw.parse()]
        last = chunks[-1].model_extra["prefixgate"]
        assert all("prefixgate" not in (c.model_extra or {}) for c in chunks[:-1])
        # the head's prediction (gateway tokens) is the summary's (upstream tokens), rescaled
        head_rate = float(raw.headers["x-prefixgate-hit-rate"])
        assert abs(head_rate - last["predicted_cached_tokens"] / last["prompt_tokens"]) < 0.01
        assert raw.headers["x-prefixgate-usage"] == "estimated"  # the head's counts are ours
        if include:
            usage = chunks[-1].usage
            cached = usage.prompt_tokens_details.cached_tokens
            _agree(raw.headers, last, usage.prompt_tokens, cached)
        rows = records(app)
        assert rows[-1].cached_tokens == last["cached_tokens"]
        assert rows[-1].reported_cached_tokens == last["reported_cached_tokens"]
    assert any(r.cached_tokens > 0 for r in records(app))  # the trace did hit
    app.state.store.close()


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def test_usage_the_upstream_never_sent_is_marked_estimated(tmp_path: Path) -> None:
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "hi there"},
                              "finish_reason": None}]}
        stop = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        return httpx.Response(200, content=_sse(chunk, stop),
                              headers={"content-type": "text/event-stream"})

    app = gateway_app(tmp_path, pool_over_handler(handler))
    client = _sdk(app)
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "say hi " * 50}], stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in raw.parse()]
    assert sent[0]["stream_options"] == {"include_usage": True}  # asked for it upstream
    assert raw.headers["x-prefixgate-usage"] == "estimated"
    summary = chunks[-1].model_extra["prefixgate"]
    assert summary["usage"] == "estimated" and summary["cached_tokens_source"] == "predicted"
    assert chunks[-1].usage.prompt_tokens == summary["prompt_tokens"] > 0
    row = records(app)[-1]
    assert row.usage_estimated and row.prompt_tokens == summary["prompt_tokens"]
    app.state.store.close()


async def test_anthropic_stream_summary_equals_message_delta_usage(tmp_path: Path) -> None:
    app = gateway_app(tmp_path, pool_over(fake_replicas(1)))
    # the anthropic SDK runs on httpx2, so its in-process transport comes from there
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    client = anthropic.AsyncAnthropic(base_url="http://gw", api_key="none", http_client=http,
                                      max_retries=0)
    body = {"model": "fake", "max_tokens": 16, "system": "You are careful. " * 200,
            "messages": [{"role": "user", "content": "Plan the change."}]}
    for _ in range(2):
        raw = await client.messages.with_raw_response.create(stream=True, **body)
        events = [e async for e in await raw.parse()]
        delta = next(e for e in events if e.type == "message_delta")
        summary = delta.model_extra["prefixgate"]
        prompt = delta.usage.input_tokens + (delta.usage.cache_read_input_tokens or 0)
        assert summary["cached_tokens"] == (delta.usage.cache_read_input_tokens or 0)
        assert summary["prompt_tokens"] == prompt
    assert summary["cached_tokens"] > 0  # the second one hit
    app.state.store.close()


async def test_prefill_saved_through_llama_server_is_its_own_timing(tmp_path: Path) -> None:
    """Through a llama.cpp server the prefill a hit saved is its cached tokens times the
    server's own prefill time per token (`timings.prompt_ms` / `prompt_n`, fake: 0.5 ms), in
    the header, the summary and the record; 0 until the server has timed a prefill of at
    least PREFILL_SAMPLE_TOKENS tokens, and never from an upstream that does not time."""
    from gateway.backends.openai_answer import PREFILL_SAMPLE_TOKENS
    from gateway.fake_llama_server import FakeLlamaConfig, create_fake_llama_server

    server = create_fake_llama_server(FakeLlamaConfig(slots=1, prompt_ms_per_token=0.5))
    app = gateway_app(tmp_path, pool_over([server], kind="llamacpp"))
    client = _sdk(app)
    system = "You triage build failures for the release team and answer in one line. " * 30
    history = [{"role": "system", "content": system}]
    saved = []
    for question in ("first failure?", "second failure?", "third failure?"):
        history.append({"role": "user", "content": question})
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=history)
        out = raw.parse()
        history.append({"role": "assistant", "content": out.choices[0].message.content})
        cached = out.usage.prompt_tokens_details.cached_tokens
        summary = out.model_extra["prefixgate"]
        assert float(raw.headers["x-prefixgate-prefill-saved-ms"]) == summary["prefill_saved_ms"]
        saved.append((cached, summary["prefill_saved_ms"]))
    assert out.usage.prompt_tokens > PREFILL_SAMPLE_TOKENS  # the first request timed prefill
    assert saved[0] == (0, 0.0)
    assert all(c > 0 and ms == round(0.5 * c, 1) for c, ms in saved[1:])
    assert [round(r.prefill_saved_ms, 1) for r in records(app)] == [ms for _, ms in saved]
    # an OpenAI-compatible upstream without timings: a hit, but no prefill time is claimed
    plain = gateway_app(tmp_path / "plain", pool_over(fake_replicas(1)))
    for _ in range(2):
        again = await _sdk(plain).chat.completions.create(model="fake", messages=history)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.model_extra["prefixgate"]["prefill_saved_ms"] == 0.0


def test_an_upstream_stream_cut_short_is_recorded_with_its_estimate(tmp_path: Path) -> None:
    """A client that leaves an upstream stream: the record keeps the head's prompt and
    predicted cached tokens and counts the chunks that came (one token each), marked
    estimated, rather than zeros."""
    sent = [0]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=slow_words(sent),
                              headers={"content-type": "text/event-stream"})

    app = gateway_app(tmp_path, pool_over_handler(handler))
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go " * 80}]}
    with serving(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            head = response.headers
            data = [line for line in itertools.islice(response.iter_lines(), 10)
                    if line.startswith("data: {")]
        rows = _await_records(app)
    (row,) = rows
    assert row.status == 499 and row.usage_estimated
    assert row.prompt_tokens == int(head["x-prefixgate-prompt-tokens"]) > 0
    assert row.cached_tokens == int(head["x-prefixgate-cached-tokens"])
    assert head["x-prefixgate-usage"] == "estimated"
    assert len(data) - 1 <= row.completion_tokens <= sent[0] < 200  # the role chunk is no token
    app.state.store.close()


def _await_records(app: Any) -> list[Any]:
    deadline = time.monotonic() + 10
    while not (rows := records(app)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return rows


async def test_a_whole_answer_without_usage_counts_its_completion(tmp_path: Path) -> None:
    """An upstream that sends no usage on a whole answer: the completion is prefixgate's own
    count of the answer (tiktoken, the reference here), marked estimated, not 0."""
    reply = "Hello world here, the weather in Paris is mild today."

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                         "finish_reason": "stop"}]})

    app = gateway_app(tmp_path, pool_over_handler(handler))
    expected = len(get_encoding().encode_ordinary(reply))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        chat = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "weather?"}]})
        anth = await client.post("/v1/messages", json={
            "model": "m", "max_tokens": 30, "messages": [{"role": "user", "content": "weather?"}]})
    assert chat.json()["usage"]["completion_tokens"] == expected > 0
    assert anth.json()["usage"]["output_tokens"] == expected
    assert chat.headers["x-prefixgate-usage"] == "estimated"
    rows = records(app)
    assert [(r.completion_tokens, r.usage_estimated) for r in rows] == [(expected, True)] * 2
    app.state.store.close()
