"""OpenAI-compatible upstream through the gateway: passthrough, cache reports, faults, keys."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from gateway.app import create_app
from gateway.backends.openai_answer import read_usage
from gateway.backends.openai_upstream import build_body, derive_prompt_cache_key
from gateway.backends.upstream_http import UpstreamOptions
from gateway.config import GatewayConfig
from gateway.fake_upstream import render_prompt
from gateway.shadow import ShadowCache, ShadowConfig, request_prompt
from gateway.types import Final
from prompt_lint.media import MEDIA_TOKENS
from prompt_lint.tokens import get_encoding

from .upstream_helpers import (
    chat_request,
    fake_replicas,
    gateway_app,
    pool_over,
    pool_over_handler,
    records,
)

SYSTEM = "You are a build agent. Follow the repository conventions. " * 60


def sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://gw/v1", http_client=http,
                              max_retries=0)


def anthropic_sdk(app: Any) -> anthropic.AsyncAnthropic:
    # The anthropic SDK runs on httpx2, so its in-process transport comes from there.
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return anthropic.AsyncAnthropic(api_key="unused", base_url="http://gw", http_client=http,
                                    max_retries=0)


def fake_reference(bodies: list[dict[str, Any]], page: int = 16) -> list[int]:
    """Independent reference: cached tokens = longest page-aligned common prefix with any
    earlier prompt (what a perfect prefix cache reports)."""
    seen: list[list[int]] = []
    out = []
    for body in bodies:
        tokens = get_encoding().encode_ordinary(render_prompt(body))
        best = 0
        for old in seen:
            n = 0
            while n < min(len(old), len(tokens)) and old[n] == tokens[n]:
                n += 1
            best = max(best, n // page * page)
        out.append(best)
        seen.append(tokens)
    return out


def test_read_usage_formats() -> None:
    openai_usage = {"prompt_tokens": 2006, "completion_tokens": 300,
                    "prompt_tokens_details": {"cached_tokens": 1920}}
    deepseek = {"prompt_tokens": 500, "completion_tokens": 9, "prompt_cache_hit_tokens": 448,
                "prompt_cache_miss_tokens": 52}
    assert read_usage(openai_usage) == (2006, 300, 1920)
    assert read_usage(deepseek) == (500, 9, 448)
    assert read_usage({"prompt_tokens": 5, "completion_tokens": 1}) == (5, 1, None)
    assert read_usage(None) == (0, 0, None)


def test_prompt_cache_key_passthrough_and_derived() -> None:
    official = UpstreamOptions(url="https://api.openai.com/v1")
    local = UpstreamOptions(url="http://127.0.0.1:8001/v1")
    msgs = [{"role": "user", "content": "hi"}]
    req = chat_request(msgs, family="fam-a", namespace="acme")
    _, body = build_body(req, official)
    assert body["prompt_cache_key"] == derive_prompt_cache_key("acme", "fam-a")
    assert derive_prompt_cache_key("acme", "fam-a") != derive_prompt_cache_key("other", "fam-a")
    _, body = build_body(req, local)  # a self-hosted server may reject unknown fields
    assert "prompt_cache_key" not in body
    own = chat_request(msgs, family="fam-a",
                       body={"model": "fake", "messages": msgs, "prompt_cache_key": "mine"})
    assert build_body(own, official)[1]["prompt_cache_key"] == "mine"
    streamed = chat_request(msgs, stream=True)
    path, body = build_body(streamed, local)
    assert path == "/chat/completions" and body["stream_options"] == {"include_usage": True}


async def test_agent_turns_report_and_predict_cached_tokens(tmp_path: Path) -> None:
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    client = sdk(app)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    usages = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"step {turn}: run the tests"})
        stream = turn % 2 == 1
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="gpt-test", messages=messages, stream=True,
                stream_options={"include_usage": True})]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            done = await client.chat.completions.create(model="gpt-test", messages=messages)
            text, usage = done.choices[0].message.content, done.usage
        assert text == "Done. The next step is ready. "
        usages.append(usage)
        messages.append({"role": "assistant", "content": text})
    expected = fake_reference(replica.state.replica.config.bodies)
    assert expected[0] == 0 and all(e > 0 for e in expected[1:])
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == expected
    rows = records(app)
    assert [r.reported_cached_tokens for r in rows] == expected
    assert [r.status for r in rows] == [200] * 4 and all(r.replica == "r0" for r in rows)
    predicted = [r.predicted_cached_tokens for r in rows]
    assert predicted[0] == 0 and all(p > 0 for p in predicted[1:])
    for p, e in zip(predicted[1:], expected[1:], strict=True):  # two tokenizations, one prefix
        assert abs(p - e) <= 32
    metrics = (await client._client.get("http://gw/metrics")).text
    total_reported = sum(expected)
    assert (f'prefixgate_upstream_reported_cached_tokens_total{{replica="r0"}} {total_reported}'
            in metrics)
    assert f'prefixgate_upstream_predicted_cached_tokens_total{{replica="r0"}} {sum(predicted)}' \
        in metrics
    app.state.store.close()
    await pool.aclose()


async def test_completion_fields_pass_to_an_openai_upstream(tmp_path: Path) -> None:
    """best_of and suffix are the embedded engine's 400s; an OpenAI-compatible upstream gets
    them in the body and answers for them itself (logit_bias too, once its shape is checked)."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    out = await sdk(app).completions.create(model="m", prompt="def f(", max_tokens=8,
                                            best_of=3, suffix="    return x\n",
                                            logit_bias={"7": -100})
    assert out.choices[0].text
    sent = replica.state.replica.config.bodies[0]
    assert (sent["best_of"], sent["suffix"]) == (3, "    return x\n")
    assert sent["logit_bias"] == {"7": -100}
    app.state.store.close()
    await pool.aclose()


async def _refused_before_api_openai_com(tmp_path: Path, body: dict[str, Any]) -> httpx.Response:
    """An Anthropic client's `body` through a gateway over api.openai.com, answered by the
    gateway itself: the upstream is never sent a request."""
    sent: list[Any] = []
    pool = pool_over_handler(lambda request: sent.append(request) or httpx.Response(500),
                             url="https://api.openai.com/v1")
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/messages", json=body)
    app.state.store.close()
    await pool.aclose()
    assert not sent
    return r


async def test_anthropic_top_k_on_openai_upstreams(tmp_path: Path) -> None:
    """An Anthropic client's top_k goes to an OpenAI-compatible server (vLLM's extension);
    api.openai.com has no top_k, so there it is a 400 naming the field, not a silent drop."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path / "vllm", pool)
    body = {"model": "m", "max_tokens": 8, "top_k": 3,
            "messages": [{"role": "user", "content": "hello"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert replica.state.replica.config.bodies[0]["top_k"] == 3
    app.state.store.close()
    await pool.aclose()
    r = await _refused_before_api_openai_com(tmp_path / "openai", body)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "top_k" in r.json()["error"]["message"]


async def test_an_anthropic_prefill_is_continued_by_servers_that_can(tmp_path: Path) -> None:
    """An Anthropic client's final assistant message is the start of the answer. vLLM and
    SGLang answered it in a new assistant turn (the body asked for a generation prompt after
    it); they are now asked to continue it. A server of unknown kind gets the messages as sent;
    api.openai.com cannot continue a message, so there it is a 400, before anything is sent."""
    prefill = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "The colour is"}]
    for kind, continued in (("vllm", True), ("sglang", True), ("openai", False)):
        [replica] = fake_replicas(1, server="vllm" if kind == "openai" else kind)
        pool = pool_over([replica], kind=kind)
        app = gateway_app(tmp_path / kind, pool)
        claude = anthropic_sdk(app)
        await claude.messages.create(model="m", max_tokens=8, messages=prefill)
        plain = [{"role": "user", "content": "Name a colour."}]
        await claude.messages.create(model="m", max_tokens=8, messages=plain)
        first, second = replica.state.replica.config.bodies
        assert first["messages"][-1] == {"role": "assistant", "content": "The colour is"}
        flags = {k: first[k] for k in ("continue_final_message", "add_generation_prompt")
                 if k in first}
        assert flags == ({"continue_final_message": True, "add_generation_prompt": False}
                         if continued else {}), kind
        assert "continue_final_message" not in second and "add_generation_prompt" not in second
        app.state.store.close()
        await pool.aclose()
    r = await _refused_before_api_openai_com(tmp_path / "api", {
        "model": "m", "max_tokens": 8, "messages": prefill})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "prefill" in r.json()["error"]["message"]


async def test_anthropic_output_format_and_thinking_on_an_openai_upstream(tmp_path: Path) -> None:
    """An Anthropic client's output_config.format becomes OpenAI's response_format
    json_schema; extended thinking has no OpenAI field, so it is a 400 naming it."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        ok = await client.post("/v1/messages", json={
            **body, "thinking": {"type": "disabled"}, "output_config": {
                "effort": "low", "format": {"type": "json_schema", "schema": schema}}})
        refused = await client.post("/v1/messages", json={
            **body, "thinking": {"type": "enabled", "budget_tokens": 2048}})
    assert ok.status_code == 200, ok.text
    [sent] = replica.state.replica.config.bodies
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema}}
    assert "thinking" not in sent and "output_config" not in sent
    assert refused.status_code == 400 and "thinking" in refused.json()["error"]["message"]
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "read_file"},
     {"tool_choice": {"type": "function", "function": {"name": "read_file"}}}),
    ({"type": "any", "disable_parallel_tool_use": True},
     {"tool_choice": "required", "parallel_tool_calls": False}),
])
async def test_an_anthropic_tool_choice_reaches_an_openai_upstream(
        tmp_path: Path, choice: dict[str, Any], expected: dict[str, Any]) -> None:
    """An Anthropic client's tool_choice becomes OpenAI's tool_choice and parallel_tool_calls
    (it was dropped, so a forced call was left to the model)."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    tool = {"name": "read_file", "description": "read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/messages", json={
            "model": "m", "max_tokens": 8, "tools": [tool], "tool_choice": choice,
            "messages": [{"role": "user", "content": "open setup.py"}]})
    assert r.status_code == 200, r.text
    [sent] = replica.state.replica.config.bodies
    assert {k: sent[k] for k in ("tool_choice", "parallel_tool_calls") if k in sent} == expected
    assert sent["tools"][0]["function"]["name"] == "read_file"
    app.state.store.close()
    await pool.aclose()


async def test_anthropic_client_on_openai_upstream(tmp_path: Path) -> None:
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/messages", json={
            "model": "m", "max_tokens": 32, "system": SYSTEM,
            "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "Done. The next step is ready. "
    sent = replica.state.replica.config.bodies[0]
    assert sent["messages"][0] == {"role": "system", "content": SYSTEM}
    assert sent["max_tokens"] == 32
    app.state.store.close()
    await pool.aclose()


def _failing(kind: str) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        if kind == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if kind == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(503, json={"error": {"message": "overloaded"}})
    return handler


@pytest.mark.parametrize(("kind", "status", "code"), [
    ("refused", 502, "upstream_unavailable"), ("timeout", 504, "upstream_timeout"),
    ("5xx", 502, "upstream_error")])
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_faults_become_client_errors(
    tmp_path: Path, kind: str, status: int, code: str, stream: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica's fault is the client's 502/504 in its own format, which never names the
    replica (a tenant learns nothing of the deployment's hosts); its record and the gateway's
    log do."""
    pool = pool_over_handler(_failing(kind), url="http://10.1.2.3:8001/v1", name=None)
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        with caplog.at_level(logging.WARNING, logger="prefixgate.upstream"):
            r = await client.post("/v1/chat/completions", json={
                "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
            anth = await client.post("/v1/messages", json={
                "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == status and r.json()["error"]["code"] == code
        assert r.json()["error"]["message"].startswith("upstream ")
        assert anth.status_code == status and anth.json()["type"] == "error"
        for text in (r.text, anth.text):
            assert "10.1.2.3" not in text and "8001" not in text
        assert (await client.get("/healthz")).json()["status"] == "ok"
    rows = records(app)
    assert [r.status for r in rows] == [status, status]
    assert all(code.split("_")[1] in (r.error or "") or "upstream" in (r.error or "")
               for r in rows)
    assert [r.replica for r in rows] == ["10.1.2.3:8001"] * 2  # the record names who failed it
    logged = [m for m in caplog.messages if "10.1.2.3:8001" in m]
    assert len(logged) == 2
    assert all(row.request_id in m for row, m in zip(rows, logged, strict=True))
    app.state.store.close()
    await pool.aclose()


def _bad_usage_handler(kind: str, bad: Any) -> Any:
    """An upstream whose answers are right but for a token count that is no count."""
    def openai(body: dict[str, Any]) -> httpx.Response:
        usage = {"prompt_tokens": bad, "completion_tokens": 1}
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [{
                "index": 0, "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop"}], "usage": usage})
        chunks = [{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": usage}]
        return _sse([f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"])

    def anthropic(body: dict[str, Any]) -> httpx.Response:
        usage = {"input_tokens": bad, "output_tokens": 1}
        if not body.get("stream"):
            return httpx.Response(200, json={
                "id": "m", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                "usage": usage})
        events = [("message_start", {"message": {"usage": {"output_tokens": 0}}}),
                  ("content_block_start", {"index": 0, "content_block": {"type": "text"}}),
                  ("content_block_delta", {"index": 0, "delta": {
                      "type": "text_delta", "text": "ok"}}),
                  ("content_block_stop", {"index": 0}),
                  ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": usage}),
                  ("message_stop", {})]
        return _sse([f"event: {e}\ndata: {json.dumps({'type': e, **d})}" for e, d in events])

    answer = openai if kind == "openai" else anthropic
    return lambda request: answer(json.loads(request.content))


def _sse(events: list[str]) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content="".join(f"{e}\n\n" for e in events).encode())


@pytest.mark.parametrize("bad", ["many", [3], -4, 2.5])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_token_count_that_is_no_count_is_the_upstreams_fault(
        tmp_path: Path, kind: str, bad: Any, stream: bool) -> None:
    """A provider's usage whose count is not a whole number >= 0 is a 502 naming the field
    (whole) or the stream's error event (streamed), recorded against the replica; never the
    gateway's own 500, never a count made up from it."""
    url = "https://anthropic.test" if kind == "anthropic" else "http://up.test/v1"
    pool = pool_over_handler(_bad_usage_handler(kind, bad), kind=kind, url=url)
    app = gateway_app(tmp_path, pool)
    field = "usage.prompt_tokens" if kind == "openai" else "usage.input_tokens"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
        if stream:
            assert r.status_code == 200  # the head went out with the first text
            error = json.loads(r.text.split("data: ")[-2].split("\n")[0])["error"]
        else:
            assert r.status_code == 502
            error = r.json()["error"]
        assert field in error["message"] and error["message"].startswith("upstream sent")
        assert error["code"] == ("upstream_stream_cut" if stream else "upstream_error")
    [row] = records(app)
    assert row.status == 502 and row.replica == "up" and field in (row.error or "")
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize(("upstream", "status"), [(429, 429), (503, 502)])
async def test_the_providers_retry_after_reaches_the_client(
        tmp_path: Path, upstream: int, status: int) -> None:
    """A provider's `retry-after` is passed on (an SDK backs off as the provider asked, not
    within a second); one that is not whole seconds is not."""
    after = ["17", "soon"]
    pool = pool_over_handler(lambda request: httpx.Response(
        upstream, headers={"retry-after": after[0]}, json={"error": {"message": "busy"}}))
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        chat = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        anth = await client.post("/v1/messages", json={
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        after.pop(0)
        vague = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert (chat.status_code, anth.status_code, vague.status_code) == (status,) * 3
    assert chat.headers["retry-after"] == anth.headers["retry-after"] == "17"
    assert "retry-after" not in vague.headers
    app.state.store.close()
    await pool.aclose()


def _error_answer(code: Any) -> Any:
    """An upstream that answers 200 with an error body (streamed: its SSE error event)."""
    error = {"message": "model is loading, try again", "type": "server_error", "code": code}

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return _sse([f"data: {json.dumps({'error': error})}"])
        return httpx.Response(200, json={"error": error})
    return handler


@pytest.mark.parametrize(("code", "expected"), [("model_loading", "model_loading"),
                                                (503, "upstream_error")])
async def test_a_200_whose_body_is_an_error_is_the_upstreams_message(
        tmp_path: Path, code: Any, expected: str) -> None:
    """A 200 whose whole body is `{"error": {...}}` reaches the client as the same 502 its
    in-stream error event would (the reference: the streamed request's error), with the
    upstream's message and its text `code`; never "no choices"."""
    pool = pool_over_handler(_error_answer(code))
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        whole = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        streamed = await client.post("/v1/chat/completions", json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert whole.status_code == streamed.status_code == 502
    assert whole.json() == streamed.json()
    assert "model is loading, try again" in whole.json()["error"]["message"]
    assert whole.json()["error"]["code"] == expected
    rows = records(app)
    assert [(r.status, r.replica) for r in rows] == [(502, "up")] * 2
    app.state.store.close()
    await pool.aclose()


def _cut_stream_handler(request: httpx.Request) -> httpx.Response:
    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            chunk = {"choices": [{"index": 0, "delta": {"content": "partial "},
                                  "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            raise httpx.RemoteProtocolError("peer closed connection")

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Cut())


async def test_stream_cut_mid_way_is_an_sse_error_event(tmp_path: Path) -> None:
    pool = pool_over_handler(_cut_stream_handler)
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200  # headers were sent before the cut
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        texts = [e["choices"][0]["delta"].get("content") for e in events if e.get("choices")]
        assert "partial " in texts
        assert events[-1]["error"]["code"] == "upstream_stream_cut"
        assert (await client.get("/healthz")).status_code == 200
    [row] = records(app)
    assert row.status == 502 and "cut" in (row.error or "")
    assert row.replica == "up"  # the record names the replica whose stream was cut
    app.state.store.close()
    await pool.aclose()


async def test_fake_replica_clean_cut_is_detected(tmp_path: Path) -> None:
    [replica] = fake_replicas(1, cut_after=2)
    pool = pool_over([replica])
    req = chat_request([{"role": "user", "content": "hi"}], stream=True)
    texts = []
    with pytest.raises(Exception) as info:
        async for item in pool.stream(req):
            texts.append(item.text)
    assert texts == ["Done. ", "The "]
    assert getattr(info.value, "kind", None) == "upstream_stream_cut"
    await pool.aclose()


async def test_upstream_key_is_sent_but_never_shown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "sk-live-SECRET-0123456789"
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization", ""))
        return httpx.Response(500, json={"error": {"message": "boom"}})

    pool = pool_over_handler(handler, api_key=secret)
    app = gateway_app(tmp_path, pool)
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        metrics = (await client.get("/metrics")).text
    assert seen == [f"Bearer {secret}"]
    assert secret not in r.text and secret not in metrics and secret not in caplog.text
    assert secret not in repr(pool.router.replicas[0].backend.options)
    assert all(secret not in (row.error or "") for row in records(app))
    app.state.store.close()
    await pool.aclose()


async def test_stale_keepalive_connection_is_retried_once() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) % 2 == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                            request=request)
        return httpx.Response(200, json={
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    pool = pool_over_handler(handler)
    final = [x async for x in pool.stream(chat_request([{"role": "user", "content": "x"}]))][-1]
    assert final.text == "fine" and len(calls) == 2
    assert final.usage.reported_cached_tokens is None and final.usage.cached_tokens == 0
    await pool.aclose()


async def test_an_upstream_cookie_never_rides_on_the_next_request() -> None:
    """One pooled client serves every tenant: a Set-Cookie from one answer must not come
    back on another tenant's request."""
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("cookie"))
        body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        return httpx.Response(200, json=body, headers={"set-cookie": "session=tenant-a"})

    pool = pool_over_handler(handler)
    for tenant in ("a", "b"):
        items = [x async for x in pool.stream(chat_request(
            [{"role": "user", "content": "hi"}], namespace=tenant))]
        assert isinstance(items[-1], Final)
    assert seen == [None, None]
    await pool.aclose()


# JSON Schema keywords providers take in tool schemas that the embedded engine's grammar does not
PROVIDER_ONLY_SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "mode": {"not": {"const": "unsafe"}}},
    "if": {"required": ["tags"]}, "then": {"properties": {"mode": {"format": "label-id"}}}}


async def test_an_upstream_gets_tool_schemas_the_engine_grammar_would_refuse(
        tmp_path: Path) -> None:
    """The grammar is the embedded engine's: an upstream's request builds none, so a schema
    keyword only the grammar engine lacks is the provider's to judge, not a gateway 400; what
    is wrong for every backend still is one (a tool_choice naming no tool, a schema that is
    not a JSON Schema)."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    tool = {"type": "function", "function": {"name": "label", "parameters": PROVIDER_ONLY_SCHEMA}}
    client = sdk(app)
    answer = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "label it"}], tools=[tool],  # type: ignore[list-item]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "labels", "schema": PROVIDER_ONLY_SCHEMA}})
    assert answer.choices[0].message.content
    sent = replica.state.replica.config.bodies[0]
    assert sent["tools"] == [tool]
    assert sent["response_format"]["json_schema"]["schema"] == PROVIDER_ONLY_SCHEMA
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        r = await http.post("/v1/messages", json={
            "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "label", "input_schema": PROVIDER_ONLY_SCHEMA}]})
        assert r.status_code == 200, r.text
        assert replica.state.replica.config.bodies[1]["tools"][0]["function"]["parameters"] \
            == PROVIDER_ONLY_SCHEMA
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}}}}
    for extra, param, words in [
            ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "no"}}},
             "tool_choice.function.name", "'no'"),
            ({"tools": [broken]}, "tools[0].function.parameters", "properties/n/minimum")]:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], **extra)
        assert isinstance(info.value.body, dict)
        assert info.value.body["param"] == param and words in info.value.body["message"]
    assert len(replica.state.replica.config.bodies) == 2  # the 400s reached no upstream
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize(("matched", "reason", "sequence"), [
    ("END", "stop_sequence", "END"),  # vLLM: the stop string that matched
    (32000, "end_turn", None),  # a stop token's id
    (None, "end_turn", None)])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_matched_stop_string_reaches_an_anthropic_client(
        tmp_path: Path, matched: Any, reason: str, sequence: str | None, stream: bool) -> None:
    """An OpenAI-compatible server's `stop_reason` (vLLM's matched stop string) becomes
    Anthropic's stop_reason "stop_sequence" and stop_sequence, whole and streamed."""
    def handler(request: httpx.Request) -> httpx.Response:
        if not json.loads(request.content)["stream"]:
            return httpx.Response(200, json={
                "id": "c", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "one two"},
                             "finish_reason": "stop", "stop_reason": matched}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        chunks = [{"choices": [{"index": 0, "delta": {"content": "one two"},
                                "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                                "stop_reason": matched}]}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode(),
                              headers={"content-type": "text/event-stream"})

    pool = pool_over_handler(handler)
    app = gateway_app(tmp_path, pool)
    body = {"model": "m", "max_tokens": 8, "stop_sequences": ["END"], "stream": stream,
            "messages": [{"role": "user", "content": "count"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/messages", json=body)
        chat = await client.post("/v1/chat/completions", json={
            "model": "m", "stop": ["END"], "messages": [{"role": "user", "content": "count"}]})
    assert r.status_code == 200, r.text
    if stream:
        deltas = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and '"message_delta"' in line]
        got = (deltas[-1]["delta"]["stop_reason"], deltas[-1]["delta"]["stop_sequence"])
    else:
        got = (r.json()["stop_reason"], r.json()["stop_sequence"])
    assert got == (reason, sequence)
    assert chat.json()["choices"][0]["finish_reason"] == "stop"  # OpenAI's stays "stop"
    app.state.store.close()
    await pool.aclose()


def _image(seed: int, size: int = 3000) -> str:
    """Base64 of `size` distinct bytes (an inline image's data as a client sends it)."""
    return base64.b64encode(bytes((seed * 131 + i * 7) % 256 for i in range(size))).decode()


def _vision_parts(data: str) -> list[dict[str, Any]]:
    """A user message's parts as OpenAI documents them: text, an inline and a linked image,
    audio, a file."""
    return [{"type": "text", "text": "What changed between these screens?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}",
                                                "detail": "low"}},
            {"type": "image_url", "image_url": {"url": "https://example.test/before.png"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {"type": "file", "file": {"filename": "spec.pdf",
                                      "file_data": "data:application/pdf;base64,JVBERi0="}}]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_openai_vision_call_reaches_an_openai_upstream_as_sent(
        tmp_path: Path, stream: bool) -> None:
    """An OpenAI SDK call with image, audio and file parts reaches an OpenAI-compatible
    upstream with its parts as sent (it was a 400: 'must be a text part'); the stored prompt
    keeps a digest of the image, not its data."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool, store_prompts=True)
    data = _image(1)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": _vision_parts(data)}]
    client = sdk(app)
    if stream:
        chunks = [c async for c in await client.chat.completions.create(
            model="gpt-test", messages=messages, stream=True)]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        done = await client.chat.completions.create(model="gpt-test",
                                                    messages=messages)
        text = done.choices[0].message.content or ""
    assert text == "Done. The next step is ready. "
    [sent] = replica.state.replica.config.bodies
    assert sent["messages"] == messages  # the provider's documented shape, byte for byte
    [row] = records(app)
    assert row.status == 200 and data not in (row.prompt_text or "")
    assert "sha256:" in (row.prompt_text or "")
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "image_url", "image_url": {}}, "messages[0].content[1].image_url.url"),
    ({"type": "image_url", "image_url": {"url": "ftp://x/a.png"}},
     "messages[0].content[1].image_url.url"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,abc"}},
     "messages[0].content[1].image_url.url"),
    ({"type": "image_url", "image_url": "https://x/a.png"}, "messages[0].content[1].image_url"),
    ({"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": 1}},
     "messages[0].content[1].image_url.detail"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg=="}},
     "messages[0].content[1].input_audio.format"),
    ({"type": "file", "file": {"filename": "a.pdf"}}, "messages[0].content[1].file"),
    ({"type": "video_url", "video_url": {"url": "https://x/a.mp4"}},
     "messages[0].content[1].type"),
    ("https://x/a.png", "messages[0].content[1]"),
])
async def test_a_malformed_media_part_is_an_openai_400(tmp_path: Path, part: Any,
                                                        param: str) -> None:
    """A media part of the wrong shape is a 400 in OpenAI's format naming the field, before
    anything reaches the upstream; so is an image in a message other than a user's."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    image = {"type": "image_url", "image_url": {"url": "https://x/a.png"}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        for messages, where in [
                ([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}], param),
                ([{"role": "system", "content": [{"type": "text", "text": "x"}, image]},
                  {"role": "user", "content": "hi"}], "messages[0].content[1]")]:
            r = await client.post("/v1/chat/completions", json={"model": "m",
                                                                 "messages": messages})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == where and error["type"] == "invalid_request_error"
            assert where in error["message"]
    assert replica.state.replica.config.bodies == []
    app.state.store.close()
    await pool.aclose()


async def test_an_anthropic_image_reaches_an_openai_upstream_as_image_url(
        tmp_path: Path) -> None:
    """An Anthropic SDK message with images (base64 and URL) reaches an OpenAI-compatible
    upstream as image_url parts (a data URL for base64); a document, an image by file id, and
    an image inside a tool_result have no chat completions form: a 400 naming the block."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    app = gateway_app(tmp_path, pool)
    data = _image(2)
    client = anthropic_sdk(app)
    answer = await client.messages.create(model="m", max_tokens=16, messages=[{
        "role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}},
            {"type": "image", "source": {"type": "url", "url": "https://example.test/b.png"}},
            {"type": "text", "text": "with the spec."}]}])
    assert answer.content[0].text == "Done. The next step is ready. "
    [sent] = replica.state.replica.config.bodies
    assert sent["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "image_url", "image_url": {"url": "https://example.test/b.png"}},
        {"type": "text", "text": "with the spec."}]}]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}}
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                             "name": "screenshot", "input": {}}]}
    refused = [
        ([{"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": "JVBERi0="}}], "messages[0].content[0]"),
        ([{"type": "image", "source": {"type": "file", "file_id": "file_1"}}],
         "messages[0].content[0]")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        for content, path in refused:
            r = await http.post("/v1/messages", json={
                "model": "m", "max_tokens": 8, "messages": [{"role": "user",
                                                             "content": content}]})
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            assert path in r.json()["error"]["message"]
        r = await http.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "take a screenshot"}, use,
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [image]}]}]})
        assert r.status_code == 400, r.text
        assert "messages[2].content[0]" in r.json()["error"]["message"]
    assert len(replica.state.replica.config.bodies) == 1  # nothing refused reached it
    app.state.store.close()
    await pool.aclose()


async def test_different_images_never_share_a_predicted_hit_past_the_image() -> None:
    """The shadow cache's prompt of two requests that differ only in their image's data (or
    URL) parts within the image: the text after it is no predicted hit; the same image is."""
    system = {"role": "system", "content": SYSTEM}
    after = {"type": "text", "text": "Describe every difference in detail. " * 40}

    def request(url: str, tail: bool = True) -> Any:
        parts = [{"type": "text", "text": "Look:"},
                 {"type": "image_url", "image_url": {"url": url}}, *([after] if tail else [])]
        return chat_request([system, {"role": "user", "content": parts}])

    for one, other in [(f"data:image/png;base64,{_image(3)}",
                        f"data:image/png;base64,{_image(4)}"),
                       ("https://example.test/a.png", "https://example.test/b.png")]:
        shadow = ShadowCache(ShadowConfig(page_size=16))
        shadow.record(request_prompt(request(one)), "t")
        through_image = len(request_prompt(request(one, tail=False)))
        assert shadow.match_length(request_prompt(request(other)), "t") < through_image
        again = request_prompt(request(one))
        assert shadow.match_length(again, "t") == len(again) // 16 * 16


async def test_an_image_counts_a_fixed_allowance_not_its_base64(tmp_path: Path) -> None:
    """prefixgate's own count of a prompt with an image (an upstream whose tokenizer does not
    answer) is the text's count plus the documented per-image allowance (MEDIA_TOKENS), not
    the tokens of its base64 text (a 30 KB screenshot counted as ~20k tokens)."""
    pool = pool_over_handler(lambda request: httpx.Response(404), url="http://up.test/v1")
    app = gateway_app(tmp_path, pool)
    data = _image(5, 30000)
    text = [{"type": "text", "text": "What is on this screen?"}]
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": data}}]
    counts = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        for content in (text, text + image):
            r = await http.post("/v1/messages/count_tokens", json={
                "model": "m", "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 200, r.text
            assert r.headers["x-prefixgate-usage"] == "estimated"
            counts.append(r.json()["input_tokens"])
    assert MEDIA_TOKENS <= counts[1] - counts[0] <= MEDIA_TOKENS + 64
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize("mode", ["report", "rewrite"])
async def test_lint_leaves_image_parts_as_they_came(tmp_path: Path, mode: str) -> None:
    """Lint of a request with images, in report and rewrite mode, names its findings in
    x-prefixgate-lint (the system prompt's timestamp), and the upstream gets every image part
    byte-identical, from an OpenAI and an Anthropic client."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    config = GatewayConfig(db_url=f"sqlite:///{tmp_path / 'gw.db'}", lint_mode=mode)
    app = create_app(config, backend=pool)
    system = SYSTEM + "Current time: 2026-11-29T14:03:07Z."
    data = _image(6)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        openai_body = {"model": "m", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": _vision_parts(data)}]}
        anthropic_body = {"model": "m", "max_tokens": 8, "system": system, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]}
        for path, body in (("/v1/chat/completions", openai_body),
                           ("/v1/messages", anthropic_body)):
            r = await http.post(path, json=body)
            assert r.status_code == 200, r.text
            assert "PL001" in r.headers["x-prefixgate-lint"]
    sent = replica.state.replica.config.bodies
    parts = [p for p in sent[0]["messages"][-1]["content"] if p["type"] != "text"]
    assert [json.dumps(p) for p in parts] == [json.dumps(p) for p in _vision_parts(data)[1:]]
    converted = [p for p in sent[1]["messages"][-1]["content"] if p["type"] != "text"]
    assert converted == [{"type": "image_url",
                          "image_url": {"url": f"data:image/png;base64,{data}"}}]
    app.state.store.close()
    await pool.aclose()


async def test_a_screenshot_does_not_stop_lint_rewriting(tmp_path: Path) -> None:
    """The lint budget (PREFIXGATE_LINT_MAX_BYTES) counts a body without its images' inline
    data: a conversation whose screenshots pass the budget is still rewritten (it was served
    unlinted, so its system prompt's timestamp came back and the upstream's cache missed);
    text past the budget is still served unlinted."""
    [replica] = fake_replicas(1)
    pool = pool_over([replica])
    config = GatewayConfig(db_url=f"sqlite:///{tmp_path / 'gw.db'}", lint_mode="rewrite",
                           lint_max_bytes=64 << 10)
    app = create_app(config, backend=pool)
    system = SYSTEM + "Current time: 2026-11-29T14:03:07Z."
    screenshot = f"data:image/png;base64,{_image(7, 96 << 10)}"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        for user, linted in (
                ([{"type": "text", "text": "What is this?"},
                  {"type": "image_url", "image_url": {"url": screenshot}}], True),
                ("What is this? " * 10000, False)):
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}]})
            assert r.status_code == 200, r.text
            assert ("PL001" in r.headers["x-prefixgate-lint"]) is linted
            sent = replica.state.replica.config.bodies[-1]
            assert ("2026-11-29" in sent["messages"][0]["content"]) is not linted
    app.state.store.close()
    await pool.aclose()
