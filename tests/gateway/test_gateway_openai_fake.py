"""The official openai SDK against the gateway over a deterministic fake backend."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.parse_openai import parse_chat
from gateway.validate import ParseContext
from tests.support import serve

from .gateway_fakes import FAKE_MODEL, FAKE_PAGE, FakeBackend, asgi_client, words_of

SYSTEM = "You are a terse assistant. Answer in one line. " * 3
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]


def async_sdk(app, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=kwargs.pop("key", "none"),
                              http_client=asgi_client(app), max_retries=0)


def expected_cached(body: dict, namespace_seen: bool) -> int:
    """Independent reference: a repeated prompt hits all its full pages, a new one none."""
    req = parse_chat(body, ParseContext("x", "default", (FAKE_MODEL,)))
    n = len(words_of(req))
    return (n // FAKE_PAGE) * FAKE_PAGE if namespace_seen else 0


async def test_chat_round_trip_reports_cached_tokens_and_headers(make_fake_app):
    app = make_fake_app()
    client = async_sdk(app)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    body = {"model": FAKE_MODEL, "messages": messages}
    first = await client.chat.completions.with_raw_response.create(**body)
    second = await client.chat.completions.with_raw_response.create(**body)
    one, two = first.parse(), second.parse()
    assert one.choices[0].message.content == "echo: hello there"
    assert one.choices[0].finish_reason == "stop"
    assert one.usage.prompt_tokens_details.cached_tokens == expected_cached(body, False)
    assert two.usage.prompt_tokens_details.cached_tokens == expected_cached(body, True)
    assert two.usage.prompt_tokens_details.cached_tokens > 0
    headers = second.headers
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert int(headers["x-prefixgate-cached-tokens"]) == cached
    assert int(headers["x-prefixgate-prompt-tokens"]) == two.usage.prompt_tokens
    rate = two.usage.prompt_tokens_details.cached_tokens / two.usage.prompt_tokens
    assert float(headers["x-prefixgate-hit-rate"]) == pytest.approx(rate, abs=1e-4)
    assert float(headers["x-prefixgate-prefill-saved-ms"]) > 0
    assert headers["x-prefixgate-lint"] == ""


async def test_stream_with_usage_matches_non_stream(make_fake_app):
    app = make_fake_app()
    client = async_sdk(app)
    body = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "one two three four"}]}
    whole = await client.chat.completions.create(**body)
    stream = await client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True})
    texts, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(texts) == whole.choices[0].message.content
    assert finish == "stop"
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == expected_cached(body, True)


async def test_tool_call_round_trip(make_fake_app, fake_backend: FakeBackend):
    app = make_fake_app()
    client = async_sdk(app)
    messages = [{"role": "user", "content": 'CALL get_weather {"city": "Paris"}'}]
    out = await client.chat.completions.create(model=FAKE_MODEL, messages=messages, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Calling."
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny 21C"}]
    again = await client.chat.completions.create(model=FAKE_MODEL, messages=messages, tools=TOOLS)
    assert again.choices[0].message.content == "echo: sunny 21C"
    # The backend saw the whole history, tool call included.
    assert fake_backend.seen[-1].messages[1]["tool_calls"][0]["id"] == call.id


def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}} for i in ids]}


def _result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}


ASK = {"role": "user", "content": "weather in Oslo and Rome?"}


@pytest.mark.parametrize(("history", "param"), [
    ([ASK, _calls("c1"), _result("zz")], "messages[2].tool_call_id"),
    ([ASK, _result("c1")], "messages[1].tool_call_id"),
    ([ASK, _calls("c1", "c2"), _result("c1"), ASK], "messages[1].tool_calls"),
    ([ASK, _calls("c1", "c2"), _result("c1")], "messages[1].tool_calls"),
    ([ASK, _calls("c1"), ASK], "messages[1].tool_calls"),
    ([ASK, _calls("c1"), _result("c1"), ASK, _result("c1")], "messages[4].tool_call_id")])
async def test_broken_tool_round_trips_are_refused(make_fake_app, history, param):
    """OpenAI's rule: a tool message answers a call of the assistant message its run of tool
    messages follows, and each call is answered before the conversation goes on. Both breaks
    were served (results are rendered by position, so the model read one as another call's
    answer), as was a conversation ending on the answer to one of two calls: a 400 naming the
    message; closed round trips, in any order, are served."""
    client = async_sdk(make_fake_app())
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=FAKE_MODEL, messages=history, tools=TOOLS)
    assert refused.value.body["param"] == param
    for fine in ([ASK, _calls("c1", "c2"), _result("c2"), _result("c1"), ASK],
                 [ASK, _calls("c1"), _result("c1")], [ASK, _calls("c1")]):
        out = await client.chat.completions.create(model=FAKE_MODEL, messages=fine, tools=TOOLS)
        assert out.choices[0].finish_reason == "stop"


async def test_streamed_tool_call(make_fake_app):
    client = async_sdk(make_fake_app())
    stream = await client.chat.completions.create(
        model=FAKE_MODEL, tools=TOOLS, stream=True,
        messages=[{"role": "user", "content": 'CALL get_weather {"city": "Oslo"}'}])
    text, calls, finish = "", [], None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert "<tool_call>" not in text and text == "Calling."
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}}])
async def test_the_embedded_model_refuses_media_parts(make_fake_app, part):
    """The embedded model reads only text: an image, audio or file part stays the 400 it was
    (upstreams take them), in OpenAI's format, naming the part."""
    async with asgi_client(make_fake_app()) as http:
        response = await http.post("/v1/chat/completions", json={
            "model": FAKE_MODEL, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, part]}]})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "'messages[0].content[1]' must be a text part (only text is supported)",
        "type": "invalid_request_error", "param": "messages[0].content[1]", "code": None}


async def test_completions_and_models(make_fake_app):
    client = async_sdk(make_fake_app())
    out = await client.completions.create(model=FAKE_MODEL, prompt="alpha beta", max_tokens=8)
    assert out.choices[0].text == "echo: alpha beta"  # the fake echoes the raw prompt words
    assert out.usage.prompt_tokens == 2
    models = await client.models.list()
    assert [m.id for m in models.data] == [FAKE_MODEL]
    with pytest.raises(openai.BadRequestError) as refused:  # legacy logprobs: an integer
        await client.completions.create(model=FAKE_MODEL, prompt="alpha", logprobs=2)
    assert refused.value.body["param"] == "logprobs"
    out = await client.completions.create(model=FAKE_MODEL, prompt="alpha", logprobs=0)
    assert out.choices[0].logprobs is None


def test_sync_sdk_over_a_real_socket(make_fake_app):
    app = make_fake_app()
    with serve(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "over tcp"}], max_tokens=3)
        assert out.choices[0].message.content == "echo: over tcp"
        stream = client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "a b c d e"}],
            max_tokens=3, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        client.close()
        assert "".join(pieces) == "echo: a b"
        health = httpx.get(server.url + "/healthz").json()
        assert health["status"] == "ok"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": FAKE_MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": FAKE_MODEL, "messages": []}, 400, "messages"),
    ({"model": FAKE_MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    # OpenAI refuses an empty array of parts (served as an empty turn before)
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": []}]}, 400,
     "messages[0].content"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     400, "temperature"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
     400, "temperature"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0},
     400, "top_p"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     400, "max_tokens"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True},
     400, "logprobs"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": False,
      "top_logprobs": 3}, 400, "top_logprobs"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
     400, "logprobs"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "stop": [1]},
     400, "stop[0]"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "metadata": 5},
     400, "metadata"),
    *[({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}],
        "logit_bias": bias}, 400, "logit_bias")
      for bias in ({"a": 1}, {"5": 101}, {"5": -100.5}, {"5": "up"}, {"5": None}, {"-5": 1},
                   {"05": 1}, {"1" * 12: 1}, [5], "5")],
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}],
      "metadata": {"run": 1}}, 400, "metadata.run"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     400, "tools[0].function"),
    ({"model": FAKE_MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].tool_call_id"),
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "FAIL 422"}]}, 422,
     "messages"),
])
async def test_bad_input_is_a_4xx_naming_the_field(make_fake_app, body, status, param):
    app = make_fake_app()
    async with asgi_client(app) as http:
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"  # OpenAI's type, whatever the status
        assert response.headers["x-prefixgate-prompt-tokens"] == "0"
        assert (await http.get("/healthz")).status_code == 200


async def test_malformed_json_and_oversized_body(make_fake_app):
    app = make_fake_app(max_body_bytes=2048)
    async with asgi_client(app) as http:
        bad = await http.post("/v1/chat/completions", content=b"{not json",
                              headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
        arr = await http.post("/v1/chat/completions", json=[1, 2])
        assert arr.status_code == 400 and arr.json()["error"]["param"] == "body"
        big = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x" * 4096}]}
        large = await http.post("/v1/chat/completions", json=big)
        assert large.status_code == 413 and large.json()["error"]["param"] == "body"
        assert (await http.get("/healthz")).status_code == 200


async def test_sdk_raises_typed_errors(make_fake_app):
    client = async_sdk(make_fake_app())
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(
            model="gpt-unknown", messages=[{"role": "user", "content": "x"}])
    assert "gpt-unknown" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "x"}], top_p=1.5)


@pytest.mark.parametrize(("extra", "param"), [
    ({"best_of": 3}, "best_of"), ({"best_of": "2"}, "best_of"), ({"best_of": 0}, "best_of"),
    ({"suffix": "}"}, "suffix"), ({"suffix": 5}, "suffix")])
async def test_completions_refuse_best_of_and_suffix(make_fake_app, extra, param):
    """The engine samples one completion and cannot insert before a suffix: asking for either
    is a 400 naming the field (both were ignored); best_of 1 and an empty suffix are fine."""
    client = async_sdk(make_fake_app())
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=FAKE_MODEL, prompt="alpha", max_tokens=4,
                                        extra_body=extra)
    assert refused.value.body["param"] == param
    for fine in ({"best_of": 1}, {"best_of": None}, {"suffix": ""}, {"suffix": None}):
        out = await client.completions.create(model=FAKE_MODEL, prompt="alpha", max_tokens=4,
                                              extra_body=fine)
        assert out.choices[0].text == "echo: alpha"


@pytest.mark.parametrize(("extra", "param"), [
    ({"functions": [{"name": "get_weather", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"function_call": {"name": "get_weather"}}, "function_call")])
async def test_legacy_function_fields_are_refused(make_fake_app, extra, param):
    """The deprecated `functions` / `function_call` were ignored, so the model answered as if
    it had no functions: a 400 naming the field; `tools` serves the same request."""
    client = async_sdk(make_fake_app())
    messages = [{"role": "user", "content": "weather?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=FAKE_MODEL, messages=messages,
                                             extra_body=extra)
    assert refused.value.body["param"] == param
    assert "tool" in refused.value.body["message"]
    out = await client.chat.completions.create(model=FAKE_MODEL, messages=messages,
                                               tools=TOOLS, extra_body={"functions": []})
    assert out.choices[0].finish_reason in ("stop", "tool_calls")


async def test_completions_default_to_sixteen_tokens(make_fake_app):
    """OpenAI documents max_tokens 16 as /v1/completions' default (vLLM follows it); the
    gateway's chat default (256) was used instead. An explicit max_tokens still rules."""
    client = async_sdk(make_fake_app())
    prompt = " ".join(f"w{i}" for i in range(40))
    out = await client.completions.create(model=FAKE_MODEL, prompt=prompt)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    longer = await client.completions.create(model=FAKE_MODEL, prompt=prompt, max_tokens=20)
    assert longer.usage.completion_tokens == 20
    chat = await client.chat.completions.create(
        model=FAKE_MODEL, messages=[{"role": "user", "content": prompt}])
    assert chat.usage.completion_tokens > 16


async def test_vllm_top_k_extension_is_honoured(make_fake_app, fake_backend: FakeBackend):
    """OpenAI has no top_k; vLLM-style servers take it (-1 or 0: every token), and so does the
    engine: it reaches the backend, and a bad one is a 400 naming it."""
    client = async_sdk(make_fake_app())
    for top_k, expected in ((1, 1), (50, 50), (0, None), (-1, None), (None, None)):
        await client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "x"}],
            extra_body={"top_k": top_k})
        assert fake_backend.seen[-1].options.top_k == expected
    for bad in ("x", -2, 1.5, True):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=FAKE_MODEL, messages=[{"role": "user", "content": "x"}],
                extra_body={"top_k": bad})
        assert refused.value.body["param"] == "top_k"


async def test_logit_bias_reaches_the_backend(make_fake_app, fake_backend: FakeBackend):
    """logit_bias (token id text -> bias in [-100, 100]) reaches the backend as id-ordered
    pairs (it was ignored, even when invalid); empty or null is no bias."""
    client = async_sdk(make_fake_app())
    for bias, expected in (({"70": -2.5, "5": 100}, ((5, 100.0), (70, -2.5))), ({}, ()),
                           (None, ())):
        await client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "x"}], logit_bias=bias)
        assert fake_backend.seen[-1].options.logit_bias == expected
    await client.completions.create(model=FAKE_MODEL, prompt="x", logit_bias={"9": -100})
    assert fake_backend.seen[-1].options.logit_bias == ((9, -100.0),)


async def test_metadata_of_strings_is_accepted(make_fake_app):
    client = async_sdk(make_fake_app())
    for metadata in ({"run": "7", "team": "core"}, {}, None):
        out = await client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "x"}],
            extra_body={"metadata": metadata})
        assert out.choices[0].message.content == "echo: x"


async def test_unknown_model_is_openais_model_not_found(make_fake_app):
    """OpenAI's shape for an unknown model: 404, type invalid_request_error, code
    model_not_found (the type and code were swapped: not_found_error is Anthropic's type)."""
    client = async_sdk(make_fake_app())
    with pytest.raises(openai.NotFoundError) as chat:
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as legacy:
        await client.completions.create(model="nope", prompt="x")
    for err in (chat.value, legacy.value):
        assert err.status_code == 404
        assert err.body["type"] == "invalid_request_error"
        assert err.body["code"] == "model_not_found"
        assert err.body["param"] == "model"
        assert "nope" in err.body["message"]
