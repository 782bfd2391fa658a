"""Anthropic upstream: cache_control breakpoints, cache reports, conversion, stream errors."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.backends.anthropic_format import MAX_BREAKPOINTS, place_cache_breakpoints
from gateway.backends.anthropic_upstream import read_usage
from prompt_lint.tokens import get_encoding

from .upstream_helpers import gateway_app, pool_over_handler, records

SYSTEM = "You are a release agent for the payments team. Check every change twice. " * 80
TOOL = {"name": "read_file", "description": "read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}


def _blocks(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Reference layout of a Messages body: tools, system blocks, message blocks, in order."""
    out = [dict(t) for t in body.get("tools") or ()]
    system = body.get("system") or []
    out += [{"type": "text", "text": system}] if isinstance(system, str) else list(system)
    for m in body["messages"]:
        content = m["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        out += [{"role": m["role"], **b} for b in blocks]
    return out


class FakeAnthropic:
    """Caches prompt prefixes only at cache_control breakpoints, like the Messages API."""

    def __init__(self, reply: list[dict[str, Any]] | None = None) -> None:
        self.cached: set[str] = set()
        self.bodies: list[dict[str, Any]] = []
        self.reply = reply or [{"type": "text", "text": "Shipped it."}]
        self.fail_mid_stream = False
        self.stop: tuple[str, str | None] | None = None  # (stop_reason, stop_sequence) to send

    def usage(self, body: dict[str, Any]) -> dict[str, int]:
        """Reads: the longest cached prefix ending at most 20 blocks before a breakpoint."""
        blocks = _blocks(body)
        plain = [{k: v for k, v in b.items() if k != "cache_control"} for b in blocks]
        sizes = [0]
        for b in plain:
            sizes.append(sizes[-1] + len(get_encoding().encode_ordinary(json.dumps(b))))
        keys = [json.dumps(plain[:i + 1]) for i in range(len(plain))]
        marks = [i for i, b in enumerate(blocks) if "cache_control" in b]
        read = max((sizes[j + 1] for i in marks for j in range(max(0, i - 20), i + 1)
                    if keys[j] in self.cached), default=0)
        written = max((sizes[i + 1] for i in marks), default=0)
        self.cached.update(keys[i] for i in marks)
        total = sizes[-1]
        return {"input_tokens": total - max(read, written), "cache_read_input_tokens": read,
                "cache_creation_input_tokens": max(written - read, 0), "output_tokens": 4}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/messages"
        body = json.loads(request.content)
        self.bodies.append(body)
        usage = self.usage(body)
        if not body.get("stream"):
            return httpx.Response(200, json={
                "id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
                "content": self.reply, **self.stop_fields(), "usage": usage})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self.sse(body, usage))

    def stop_fields(self) -> dict[str, Any]:
        if self.stop is not None:
            return {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}
        tool = any(b["type"] == "tool_use" for b in self.reply)
        return {"stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None}

    def sse(self, body: dict[str, Any], usage: dict[str, int]) -> bytes:
        start = {k: v for k, v in usage.items() if k != "output_tokens"} | {"output_tokens": 1}
        events: list[tuple[str, dict[str, Any]]] = [("message_start", {
            "type": "message_start", "message": {"id": "msg_1", "type": "message",
                                                 "role": "assistant", "content": [],
                                                 "model": body["model"], "usage": start}})]
        events.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}}))
        for word in ("Shipped ", "it."):
            events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta",
                                                             "text": word}}))
            if self.fail_mid_stream:
                events.append(("error", {"type": "error", "error": {
                    "type": "overloaded_error", "message": "Overloaded"}}))
                break
        else:
            events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                       ("message_delta", {"type": "message_delta",
                                          "delta": self.stop_fields(),
                                          "usage": {"output_tokens": 4}}),
                       ("message_stop", {"type": "message_stop"})]
        return "".join(f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events).encode()


def _markers(body: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    return [(i, b["cache_control"]) for i, b in enumerate(_blocks(body)) if "cache_control" in b]


def _strip(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "cache_control"} for b in _blocks(body)]


def test_breakpoints_at_stable_boundary() -> None:
    body = {"model": "c", "system": SYSTEM, "tools": [TOOL], "messages": [
        {"role": "user", "content": "deploy"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file",
                                           "input": {"path": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "ok"}]}]}
    out = place_cache_breakpoints(body)
    assert [i for i, _ in _markers(out)] == [0, 1, 3]  # last tool, system, end of history
    assert _strip(out) == _strip(body)
    assert "cache_control" not in json.dumps(body)  # the input is not mutated


def test_client_breakpoints_kept_and_total_capped() -> None:
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}}
        for i in range(3)]}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "next"}]
    body = {"model": "c", "system": SYSTEM, "tools": [TOOL], "messages": msgs}
    out = place_cache_breakpoints(body)
    kept = [i for i, _ in _markers(body)]
    assert set(kept) < {i for i, _ in _markers(out)}
    assert len(_markers(out)) == MAX_BREAKPOINTS
    assert out["messages"][1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    full = copy.deepcopy(body)
    full["messages"][1]["content"] = [{"type": "text", "text": "ok",
                                       "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert place_cache_breakpoints(full) == full  # four already: nothing added or moved


block = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(min_size=0, max_size=5)},
                              optional={"cache_control": st.just({"type": "ephemeral"})})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                 "content": st.one_of(st.text(max_size=5),
                                                      st.lists(block, max_size=3))})


@settings(max_examples=80, deadline=None)
@given(st.lists(message, min_size=1, max_size=5), st.one_of(st.none(), st.text(max_size=5)),
       st.booleans())
def test_breakpoint_rules_hold_for_any_body(messages: list[Any], system: Any, tools: bool) -> None:
    body: dict[str, Any] = {"model": "c", "messages": messages}
    if system is not None:
        body["system"] = system
    if tools:
        body["tools"] = [dict(TOOL)]
    out = place_cache_breakpoints(body)
    before, after = _markers(body), _markers(out)
    assert {i for i, _ in before} <= {i for i, _ in after}
    assert len(after) <= max(MAX_BREAKPOINTS, len(before))
    assert _strip(out) == _strip(body)
    assert all(b.get("text") != "" for i, b in enumerate(_blocks(out))
               if i in {j for j, _ in after} - {j for j, _ in before})


def test_read_usage_sums_prompt() -> None:
    u = read_usage({"input_tokens": 10, "cache_read_input_tokens": 2000,
                    "cache_creation_input_tokens": 300, "output_tokens": 7})
    assert u == (2310, 7, 2000, 300)
    assert read_usage({"input_tokens": 5, "output_tokens": 1}).reported_cached_tokens is None


def _sdk(app: Any) -> anthropic.AsyncAnthropic:
    # The anthropic SDK runs on httpx2, so its in-process transport comes from there.
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return anthropic.AsyncAnthropic(api_key="unused", base_url="http://gw", http_client=http,
                                    max_retries=0)


async def test_agent_loop_reads_cache_reads_back(tmp_path: Path) -> None:
    fake = FakeAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test", api_key="ak")
    app = gateway_app(tmp_path, pool)
    client = _sdk(app)
    messages: list[dict[str, Any]] = []
    reads = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: check the release notes"})
        if turn == 2:
            async with client.messages.stream(model="claude-test", max_tokens=64, system=SYSTEM,
                                              messages=messages) as stream:
                final = await stream.get_final_message()
        else:
            final = await client.messages.create(model="claude-test", max_tokens=64,
                                                 system=SYSTEM, messages=messages)
        assert final.content[0].text == "Shipped it."
        reads.append(final.usage.cache_read_input_tokens)
        messages.append({"role": "assistant", "content": final.content[0].text})
    # The fake's own accounting is the reference: what it read back is what the client saw.
    rows = records(app)
    assert reads[0] == 0 and reads[1] > 0 and reads[2] > reads[1]
    assert [r.reported_cached_tokens for r in rows] == reads
    assert all(r.predicted_cached_tokens is not None for r in rows)
    assert rows[2].predicted_cached_tokens > 0
    sent = fake.bodies[1]
    assert _markers(sent) and all("x-api-key" not in json.dumps(b) for b in fake.bodies)
    app.state.store.close()
    await pool.aclose()


class SpyAnthropic(FakeAnthropic):
    """The fake upstream, keeping the usage object it sent each time (the reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.usages: list[dict[str, int]] = []

    def usage(self, body: dict[str, Any]) -> dict[str, int]:
        self.usages.append(super().usage(body))
        return self.usages[-1]


def _prompt_side(usage: Any) -> tuple[int, int, int]:
    return (usage.input_tokens, usage.cache_read_input_tokens or 0,
            usage.cache_creation_input_tokens or 0)


async def test_an_anthropic_client_gets_the_upstreams_cache_writes(tmp_path: Path) -> None:
    """Anthropic bills cache writes apart (`cache_creation_input_tokens`, outside
    `input_tokens`): an Anthropic client gets the upstream's own three prompt figures, whole
    and streamed (message_start and message_delta), not the writes folded into input_tokens
    with cache_creation_input_tokens 0."""
    fake = SpyAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    client = _sdk(app)
    messages: list[dict[str, Any]] = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: check the notes " * 20})
        ask: dict[str, Any] = dict(model="claude-test", max_tokens=64, system=SYSTEM,
                                   messages=messages)
        if turn == 2:
            async with client.messages.stream(**ask) as stream:
                events = [e async for e in stream]
            start = next(e for e in events if e.type == "message_start").message.usage
            delta = next(e for e in events if e.type == "message_delta").usage
            got = [_prompt_side(start), _prompt_side(delta)]
        else:
            answer = await client.messages.create(**ask)
            got = [_prompt_side(answer.usage)]
        assert got == [_fields(fake.usages[-1])] * len(got), turn
        messages.append({"role": "assistant", "content": "Shipped it."})
    assert any(u["cache_creation_input_tokens"] > 0 for u in fake.usages)  # writes were made
    rows = records(app)
    assert [r.prompt_tokens for r in rows] == [sum(_fields(u)) for u in fake.usages]
    app.state.store.close()
    await pool.aclose()


def _fields(usage: dict[str, int]) -> tuple[int, int, int]:
    return (usage["input_tokens"], usage["cache_read_input_tokens"],
            usage["cache_creation_input_tokens"])


@pytest.mark.parametrize(("stop", "finish"), [
    (("stop_sequence", "##"), "stop"), (("refusal", None), "content_filter"),
    (("pause_turn", None), "stop"), (("end_turn", None), "stop"),
    (("model_context_window_exceeded", None), "length")])
async def test_upstream_stop_reason_and_sequence_reach_the_client(
    tmp_path: Path, stop: tuple[str, str | None], finish: str
) -> None:
    """An Anthropic upstream's stop_reason and stop_sequence reach an Anthropic client as they
    are, whole and streamed (before: stop_sequence, refusal, pause_turn all became end_turn
    with a null stop_sequence); an OpenAI client gets the nearest finish_reason."""
    fake = FakeAnthropic()
    fake.stop = stop
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    client = _sdk(app)
    ask: dict[str, Any] = dict(model="claude-test", max_tokens=64, stop_sequences=["##"],
                               messages=[{"role": "user", "content": "ship it"}])
    whole = await client.messages.create(**ask)
    async with client.messages.stream(**ask) as stream:
        events = [e async for e in stream]
        streamed = await stream.get_final_message()
    for message in (whole, streamed):
        assert (message.stop_reason, message.stop_sequence) == stop
    deltas = [e.delta for e in events if e.type == "message_delta"]
    assert [(d.stop_reason, d.stop_sequence) for d in deltas] == [stop]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        body = {"model": "claude-test", "max_tokens": 50,
                "messages": [{"role": "user", "content": "ship it"}]}
        r = await http.post("/v1/chat/completions", json=body)
        s = await http.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.json()["choices"][0]["finish_reason"] == finish
    chunks = [json.loads(line[6:]) for line in s.text.splitlines()
              if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == finish
    app.state.store.close()
    await pool.aclose()


def _read_file_gateway(tmp_path: Path) -> tuple[FakeAnthropic, Any, Any, list[dict[str, Any]]]:
    """A gateway over a fake Anthropic upstream that answers with a read_file call, and that
    tool in OpenAI's form."""
    fake = FakeAnthropic(reply=[{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                 "input": {"path": "setup.py"}}])
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    tools = [{"type": "function", "function": {"name": "read_file", "description": "read",
                                               "parameters": TOOL["input_schema"]}}]
    return fake, pool, gateway_app(tmp_path, pool), tools


async def test_openai_client_with_tools_on_anthropic_upstream(tmp_path: Path) -> None:
    fake, pool, app, tools = _read_file_gateway(tmp_path)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "open a file"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\": \"a.py\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "claude-test", "messages": msgs, "tools": tools, "max_tokens": 50})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "read_file"
    assert json.loads(call["function"]["arguments"]) == {"path": "setup.py"}
    sent = fake.bodies[0]
    assert sent["system"][0]["text"] == SYSTEM and sent["max_tokens"] == 50
    assert sent["tools"][0]["name"] == "read_file"
    use = sent["messages"][1]["content"][0]
    assert use.pop("cache_control") == {"type": "ephemeral"}  # the end of the history
    assert use == {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a.py"}}
    assert sent["messages"][2]["content"][0]["type"] == "tool_result"
    app.state.store.close()
    await pool.aclose()


async def test_upstream_error_event_mid_stream(tmp_path: Path) -> None:
    fake = FakeAnthropic()
    fake.fail_mid_stream = True
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/messages", json={
            "model": "c", "max_tokens": 9, "stream": True,
            "messages": [{"role": "user", "content": "go"}]})
        assert r.status_code == 200
        assert "Shipped " in r.text
        last = r.text.strip().split("\n\n")[-1]
        assert last.startswith("event: error")
        event = json.loads(last.split("data: ", 1)[1])
        assert event["type"] == "error" and event["error"]["type"] == "overloaded_error"
        assert (await client.get("/healthz")).status_code == 200
    [row] = records(app)
    assert row.status == 529 and "Overloaded" in (row.error or "")
    app.state.store.close()
    await pool.aclose()


def _overloaded(request: httpx.Request) -> httpx.Response:
    """Anthropic's answer when it is overloaded: 529 `overloaded_error`, with a retry-after."""
    return httpx.Response(529, headers={"retry-after": "11"}, json={
        "type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})


async def test_an_upstream_529_is_overload_to_either_client(tmp_path: Path) -> None:
    """An Anthropic upstream's 529 reaches an Anthropic client as the provider sent it (the
    SDK's OverloadedError, retry-after kept) and an OpenAI client as a 503 (the SDK's server
    error, code `overloaded_error`); the replica is backed off, as for any replica fault."""
    pool = pool_over_handler(_overloaded, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    with pytest.raises(anthropic.OverloadedError) as anth:
        await _sdk(app).messages.create(model="c", max_tokens=9, messages=[
            {"role": "user", "content": "go"}])
    assert anth.value.status_code == 529
    assert anth.value.response.headers["retry-after"] == "11"
    assert anth.value.body["error"] == {"type": "overloaded_error",  # type: ignore[index]
                                        "message": "upstream is overloaded: Overloaded"}
    [replica] = pool.router.replicas
    assert replica.failures == 1  # backed off
    replica.retry_at = 0.0  # routable again, to serve the OpenAI client's request
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    oai = openai.AsyncOpenAI(api_key="unused", base_url="http://gw/v1", http_client=http,
                             max_retries=0)
    with pytest.raises(openai.InternalServerError) as chat:
        await oai.chat.completions.create(model="c", messages=[
            {"role": "user", "content": "go"}])
    assert chat.value.status_code == 503 and chat.value.code == "overloaded_error"
    assert chat.value.response.headers["retry-after"] == "11"
    assert [r.status for r in records(app)] == [529, 503]
    app.state.store.close()
    await pool.aclose()


async def test_openai_fields_a_messages_body_cannot_carry_are_a_400(tmp_path: Path) -> None:
    """An OpenAI client's fields the Messages API has no place for are a 400 naming the field
    (they were dropped in the conversion); nothing reaches the upstream."""
    fake = FakeAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        for path, extra, param in [
                ("/v1/completions", {"best_of": 2}, "best_of"),
                ("/v1/completions", {"suffix": "}"}, "suffix"),
                ("/v1/chat/completions", {"logit_bias": {"5": 3}}, "logit_bias"),
                ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
                ("/v1/chat/completions", {"frequency_penalty": -1}, "frequency_penalty"),
                ("/v1/chat/completions", {"response_format": {"type": "json_object"}},
                 "response_format"),
                ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
                ("/v1/chat/completions", {"function_call": "auto"}, "function_call")]:
            body = {"model": "c", "max_tokens": 9, **extra}
            body |= {"prompt": "go"} if path == "/v1/completions" else {
                "messages": [{"role": "user", "content": "go"}]}
            r = await client.post(path, json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
            assert "Anthropic upstream" in r.json()["error"]["message"]
        fine = await client.post("/v1/completions", json={
            "model": "c", "max_tokens": 9, "prompt": "go", "best_of": 1, "suffix": ""})
        assert fine.status_code == 200, fine.text
        top_k = await client.post("/v1/chat/completions", json={
            "model": "c", "max_tokens": 9, "top_k": 5,
            "messages": [{"role": "user", "content": "go"}]})
        assert top_k.status_code == 200, top_k.text
    assert len(fake.bodies) == 2
    assert "top_k" not in fake.bodies[0] and fake.bodies[1]["top_k"] == 5  # vLLM's extension
    app.state.store.close()
    await pool.aclose()


async def test_thinking_and_output_format_pass_to_an_anthropic_upstream(tmp_path: Path) -> None:
    """The model behind an Anthropic upstream can think and enforces its own output format:
    both pass in the body (the embedded engine refuses thinking and builds a grammar)."""
    fake = FakeAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    extra = {"thinking": {"type": "enabled", "budget_tokens": 2048},
             "output_config": {"format": {"type": "json_schema", "schema": {
                 "type": "object", "properties": {"tags": {"type": "array",
                                                           "uniqueItems": True}}}}}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/messages", json={
            "model": "c", "max_tokens": 4096, "messages": [{"role": "user", "content": "go"}],
            **extra})
    assert r.status_code == 200, r.text
    assert {k: fake.bodies[0][k] for k in extra} == extra
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, None),
    ({"tool_choice": "auto"}, None),
    ({"tool_choice": "required"}, {"type": "any"}),
    ({"tool_choice": "none"}, {"type": "none"}),
    ({"tool_choice": {"type": "function", "function": {"name": "read_file"}}},
     {"type": "tool", "name": "read_file"}),
    ({"parallel_tool_calls": False}, {"type": "auto", "disable_parallel_tool_use": True}),
    ({"tool_choice": "required", "parallel_tool_calls": False},
     {"type": "any", "disable_parallel_tool_use": True}),
])
async def test_an_openai_tool_choice_reaches_an_anthropic_upstream(
        tmp_path: Path, extra: dict[str, Any], expected: dict[str, Any] | None) -> None:
    """OpenAI's tool_choice and parallel_tool_calls become the Messages tool_choice (they were
    dropped, so a forced call was left to the model); response_format json_schema becomes
    output_config.format."""
    fake, pool, app, tools = _read_file_gateway(tmp_path)
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "c", "max_tokens": 9, "tools": tools, **extra,
            "messages": [{"role": "user", "content": "open setup.py"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "out", "schema": schema}}})
    assert r.status_code == 200, r.text
    (sent,) = fake.bodies
    assert sent.get("tool_choice") == expected
    assert sent["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    app.state.store.close()
    await pool.aclose()


SIGNATURE = "EqQBCgIYAhIM1gbcDa9GJwZA2b3h+/=\u00e9sig123"
THINKING_REPLY = [
    {"type": "thinking", "thinking": "The user wants setup.py; read it.", "signature": SIGNATURE},
    {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
    {"type": "text", "text": "Reading it."},
    {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "setup.py"}},
]


class ThinkingAnthropic(FakeAnthropic):
    """Answers with thinking blocks and streams every reply block as the Messages API does;
    keeps each request's headers."""

    def __init__(self, reply: list[dict[str, Any]] | None = None) -> None:
        super().__init__(reply or THINKING_REPLY)
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        return super().__call__(request)

    def sse(self, body: dict[str, Any], usage: dict[str, int]) -> bytes:
        events: list[dict[str, Any]] = [{"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "model": body["model"], "usage": usage | {"output_tokens": 1}}}]
        for i, block in enumerate(self.reply):
            kind = block["type"]
            start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": "",
                              **({"citations": []} if "citations" in block else {})},
                     "tool_use": {**block, "input": {}}}.get(kind, block)
            events.append({"type": "content_block_start", "index": i, "content_block": start})
            deltas: list[dict[str, Any]] = []
            if kind == "thinking":
                half = len(block["thinking"]) // 2
                deltas = [{"type": "thinking_delta", "thinking": block["thinking"][:half]},
                          {"type": "thinking_delta", "thinking": block["thinking"][half:]},
                          {"type": "signature_delta", "signature": block["signature"]}]
            elif kind == "text":  # a cited text block: its citations one delta each
                deltas = [{"type": "text_delta", "text": block["text"]}] + [
                    {"type": "citations_delta", "citation": c} for c in block.get("citations", [])]
            elif kind == "tool_use":
                text = json.dumps(block["input"])
                deltas = [{"type": "input_json_delta", "partial_json": text[:5]},
                          {"type": "input_json_delta", "partial_json": text[5:]}]
            events += [{"type": "content_block_delta", "index": i, "delta": d} for d in deltas]
            events.append({"type": "content_block_stop", "index": i})
        stop = "tool_use" if any(b["type"] == "tool_use" for b in self.reply) else "end_turn"
        events += [{"type": "message_delta", "delta": {"stop_reason": stop},
                    "usage": {"output_tokens": 4}}, {"type": "message_stop"}]
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def _thinking_request(**extra: Any) -> dict[str, Any]:
    return {"model": "claude-test", "max_tokens": 4096, "tools": [TOOL],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "open setup.py"}], **extra}


async def test_thinking_blocks_reach_an_anthropic_client_whole_and_streamed(
        tmp_path: Path) -> None:
    """Thinking and redacted_thinking blocks arrive as the upstream sent them (the signature
    byte for byte), in their place among text and tool_use blocks, whole and streamed."""
    fake = ThinkingAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test", api_key="ak")
    app = gateway_app(tmp_path, pool)
    client = _sdk(app)
    whole = await client.messages.create(**_thinking_request())
    assert [b.model_dump(exclude_none=True) for b in whole.content] == THINKING_REPLY
    assert whole.stop_reason == "tool_use"
    async with client.messages.stream(**_thinking_request()) as stream:
        streamed = await stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == THINKING_REPLY
    assert streamed.content[0].signature == SIGNATURE  # type: ignore[union-attr]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as raw:
        r = await raw.post("/v1/messages", json=_thinking_request(stream=True))
    events = [json.loads(part.split("data: ", 1)[1]) for part in r.text.strip().split("\n\n")]
    starts = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "redacted_thinking"), (2, "text"), (3, "tool_use")]
    deltas = [(e["index"], e["delta"]["type"]) for e in events
              if e["type"] == "content_block_delta"]
    assert deltas[:3] == [(0, "thinking_delta"), (0, "thinking_delta"), (0, "signature_delta")]
    assert deltas[3:] == [(2, "text_delta"), (3, "input_json_delta"), (3, "input_json_delta")]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    assert all(b["thinking"] == {"type": "enabled", "budget_tokens": 1024} for b in fake.bodies)
    app.state.store.close()
    await pool.aclose()


async def test_thinking_blocks_sent_back_reach_the_upstream_unchanged(tmp_path: Path) -> None:
    """The tool loop with thinking on: the assistant turn goes back with its thinking blocks
    (Anthropic requires them before the tool_result), and the upstream gets them as sent."""
    fake = ThinkingAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    client = _sdk(app)
    first = await client.messages.create(**_thinking_request())
    fake.reply = [{"type": "text", "text": "It is a setup script."}]
    turn = [block.model_dump(exclude_none=True) for block in first.content]
    messages = [{"role": "user", "content": "open setup.py"},
                {"role": "assistant", "content": turn},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": "print(1)"}]}]
    second = await client.messages.create(**_thinking_request(messages=messages))
    assert second.content[0].text == "It is a setup script."  # type: ignore[union-attr]
    sent = fake.bodies[-1]["messages"][1]["content"]
    assert [{k: v for k, v in b.items() if k != "cache_control"} for b in sent] == THINKING_REPLY
    assert "cache_control" not in sent[0] and "cache_control" not in sent[1]
    app.state.store.close()
    await pool.aclose()


async def test_an_openai_client_gets_no_thinking_from_an_anthropic_upstream(
        tmp_path: Path) -> None:
    """Chat completions has no field for thinking: an OpenAI client gets the text and the
    tool call, whole and streamed."""
    fake = ThinkingAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    tools = [{"type": "function", "function": {"name": "read_file",
                                               "parameters": TOOL["input_schema"]}}]
    body = {"model": "c", "max_tokens": 50, "tools": tools,
            "messages": [{"role": "user", "content": "open setup.py"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json=body)
        s = await client.post("/v1/chat/completions", json={**body, "stream": True})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Reading it."
    assert message["tool_calls"][0]["function"]["name"] == "read_file"
    assert s.status_code == 200 and "Reading it." in s.text and "thinking" not in s.text
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_beta_reaches_the_upstream_and_client_credentials_do_not(
        tmp_path: Path, stream: bool) -> None:
    """The client's anthropic-beta header is passed on (Claude Code turns features on with
    it); its x-api-key and authorization never are: the upstream gets the gateway's key."""
    fake = ThinkingAnthropic(reply=[{"type": "text", "text": "ok"}])
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test", api_key="ak")
    app = gateway_app(tmp_path, pool)
    beta = "interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        body = {"model": "c", "max_tokens": 9, "stream": stream,
                "messages": [{"role": "user", "content": "go"}]}
        for headers in ({"anthropic-beta": beta, "x-api-key": "client-key",
                         "authorization": "Bearer client-token"},
                        {"anthropic-beta": "other-2025-01-01"}, {}):
            r = await client.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", headers={"anthropic-beta": beta}, json={
            "model": "c", "max_tokens": 9, "messages": [{"role": "user", "content": "go"}]})
        assert r.status_code == 200, r.text
    sent = fake.headers
    assert [h.get("anthropic-beta") for h in sent] == [beta, "other-2025-01-01", None, None]
    assert all(h["x-api-key"] == "ak" and "authorization" not in h for h in sent)
    assert all(h["anthropic-version"] == "2023-06-01" for h in sent)
    app.state.store.close()
    await pool.aclose()


IMAGE_DATA = base64.b64encode(bytes(range(256)) * 8).decode()


async def test_an_anthropic_image_message_reaches_an_anthropic_upstream_as_sent(
        tmp_path: Path) -> None:
    """An Anthropic SDK message with an image, a document and a screenshot inside a
    tool_result reaches an Anthropic upstream as the client sent it (it was a 400: 'only text
    is supported'); only the gateway's cache_control markers are added."""
    fake = FakeAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": IMAGE_DATA}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [
            {"type": "text", "text": "Check the release against the spec and this screen."},
            {"type": "document", "title": "spec", "source": {
                "type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQ="}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "Ship on Fridays."}},
            {"type": "image", "source": {"type": "url", "url": "https://example.test/a.png"}},
            image]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                           "name": "read_file", "input": {"path": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "shown:"}, image]},
                                     {"type": "text", "text": "Go on."}]}]
    answer = await _sdk(app).messages.create(model="claude-test", max_tokens=16, tools=[TOOL],
                                             system=SYSTEM, messages=messages)
    assert answer.content[0].text == "Shipped it."
    [sent] = fake.bodies
    assert _strip(sent) == _strip({"system": SYSTEM, "tools": [TOOL], "messages": messages})
    assert [r.status for r in records(app)] == [200]
    app.state.store.close()
    await pool.aclose()


async def test_an_openai_vision_call_reaches_an_anthropic_upstream_as_image_blocks(
        tmp_path: Path) -> None:
    """An OpenAI SDK vision call through an Anthropic upstream: image_url parts become image
    blocks (base64 or url source, as the Messages API documents them), an inline PDF a
    document block; audio and a file by id, which a Messages body cannot carry, are a 400
    naming the part, and nothing reaches the upstream."""
    fake = FakeAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    client = openai.AsyncOpenAI(api_key="unused", base_url="http://gw/v1", http_client=http,
                                max_retries=0)
    done = await client.chat.completions.create(model="claude-test", max_tokens=16, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What changed?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE_DATA}",
                                                "detail": "high"}},
            {"type": "image_url", "image_url": {"url": "https://example.test/a.png"}},
            {"type": "file", "file": {"filename": "spec.pdf",
                                      "file_data": "data:application/pdf;base64,JVBERi0="}}]}])
    assert done.choices[0].message.content == "Shipped it."
    [sent] = fake.bodies
    assert sent["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What changed?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": IMAGE_DATA}},
        {"type": "image", "source": {"type": "url", "url": "https://example.test/a.png"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": "JVBERi0="}}]}]
    for part in ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                 {"type": "file", "file": {"file_id": "file-1"}},
                 {"type": "file", "file": {"file_data": "data:text/csv;base64,YSxi"}}):
        r = await http.post("/v1/chat/completions", json={"model": "claude-test", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].content[1]"
        assert "Anthropic upstream" in r.json()["error"]["message"]
    assert len(fake.bodies) == 1
    await http.aclose()
    app.state.store.close()
    await pool.aclose()


CITATION = {"type": "char_location", "cited_text": "Ship on Fridays.", "document_index": 0,
            "document_title": "policy", "start_char_index": 0, "end_char_index": 16}
CITED_REPLY = [{"type": "text", "text": "According to the policy, "},
               {"type": "text", "text": "releases ship on Fridays", "citations": [CITATION]},
               {"type": "text", "text": "."}]


async def test_citations_reach_an_anthropic_client_whole_and_streamed(tmp_path: Path) -> None:
    """A document sent with citations enabled: the answer's cited text blocks reach an
    Anthropic client as the upstream sent them, whole and streamed (citations_delta events);
    they were dropped, the text merged into one block. An OpenAI client gets the text."""
    fake = ThinkingAnthropic(CITED_REPLY)
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    client = _sdk(app)
    request: dict[str, Any] = {"model": "claude-test", "max_tokens": 64, "messages": [{
        "role": "user", "content": [
            {"type": "document", "title": "policy", "citations": {"enabled": True},
             "source": {"type": "text", "media_type": "text/plain",
                        "data": "Ship on Fridays."}},
            {"type": "text", "text": "When do releases ship?"}]}]}
    whole = await client.messages.create(**request)
    assert [b.model_dump(exclude_none=True) for b in whole.content] == CITED_REPLY
    async with client.messages.stream(**request) as stream:
        streamed = await stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == CITED_REPLY
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "claude-test", "messages": [{"role": "user", "content": "When?"}]})
    text = "".join(b["text"] for b in CITED_REPLY)
    assert r.json()["choices"][0]["message"]["content"] == text
    app.state.store.close()
    await pool.aclose()


async def test_a_client_cache_salt_stays_in_the_gateway(tmp_path: Path) -> None:
    """`cache_salt` names a cache namespace of the gateway's; the Messages API has no such
    field (it refuses fields it does not know), so the upstream gets the body without it."""
    fake = FakeAnthropic()
    pool = pool_over_handler(fake, kind="anthropic", url="https://anthropic.test")
    app = gateway_app(tmp_path, pool)
    body = {"model": "c", "max_tokens": 9, "cache_salt": "project-7",
            "messages": [{"role": "user", "content": "go"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        for stream in (False, True):
            r = await client.post("/v1/messages", json={**body, "stream": stream})
            assert r.status_code == 200, r.text
    assert [set(sent) for sent in fake.bodies] == [set(body) - {"cache_salt"} | {"stream"}] * 2
    app.state.store.close()
    await pool.aclose()
