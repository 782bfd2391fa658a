"""An OpenAI-compatible upstream as agents see it through the official SDKs: finish reasons,
the provider's error codes, tool calls streamed as they come, model lookups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from .upstream_helpers import gateway_app, pool_over_handler

MESSAGES = [{"role": "user", "content": "hi"}]


def openai_sdk(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://gw/v1", http_client=http,
                              max_retries=0)


def anthropic_sdk(app: Any) -> anthropic.AsyncAnthropic:
    # The anthropic SDK runs on httpx2, so its in-process transport comes from there.
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw")
    return anthropic.AsyncAnthropic(api_key="unused", base_url="http://gw", http_client=http,
                                    max_retries=0)


def sse(chunks: list[dict[str, Any]]) -> httpx.Response:
    """An OpenAI-style event stream of `chunks`, then `[DONE]`."""
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=text.encode())


def answer(text: str, finish: str) -> Any:
    """A handler answering every request with `text` and the finish reason `finish`, whole or
    streamed as the request asks."""
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}

    def handler(request: httpx.Request) -> httpx.Response:
        if not json.loads(request.content).get("stream"):
            return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish}], "usage": usage})
        return sse([{"choices": [{"index": 0, "delta": {"content": text},
                                  "finish_reason": None}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                    {"choices": [], "usage": usage}])
    return handler


@pytest.mark.parametrize("stream", [False, True])
async def test_a_content_filter_stop_reaches_the_client_as_one(tmp_path: Path,
                                                               stream: bool) -> None:
    """An upstream's `content_filter` finish is the OpenAI client's `content_filter` and the
    Anthropic client's `refusal`, whole and streamed: never a plain stop, which an agent would
    take for a finished answer."""
    pool = pool_over_handler(answer("I can", "content_filter"))
    app = gateway_app(tmp_path, pool)
    oai, anth = openai_sdk(app), anthropic_sdk(app)
    if stream:
        chunks = [c async for c in await oai.chat.completions.create(
            model="m", messages=MESSAGES, stream=True)]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        async with anth.messages.stream(model="m", max_tokens=9, messages=MESSAGES) as s:
            message = await s.get_final_message()
    else:
        finish = (await oai.chat.completions.create(
            model="m", messages=MESSAGES)).choices[0].finish_reason
        message = await anth.messages.create(model="m", max_tokens=9, messages=MESSAGES)
    assert finish == "content_filter"
    assert message.stop_reason == "refusal"
    app.state.store.close()
    await pool.aclose()


OPENAI_REFUSALS = [  # (status, the provider's error object) as api.openai.com answers them
    (400, {"message": "This model's maximum context length is 8192 tokens.",
           "type": "invalid_request_error", "param": "messages",
           "code": "context_length_exceeded"}),
    (429, {"message": "You exceeded your current quota.", "type": "insufficient_quota",
           "param": None, "code": "insufficient_quota"}),
    (400, {"message": "Invalid value for 'temperature'.", "type": "invalid_request_error",
           "param": "temperature", "code": "invalid_value"}),
]


@pytest.mark.parametrize(("status", "error"), OPENAI_REFUSALS)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_providers_error_code_and_param_reach_the_client(
        tmp_path: Path, status: int, error: dict[str, Any], stream: bool) -> None:
    """A refusal's `code` and `param` reach the OpenAI client as the provider sent them (an
    agent compacts its history on `context_length_exceeded` and stops retrying on
    `insufficient_quota`); the Anthropic client's message names the field."""
    pool = pool_over_handler(lambda request: httpx.Response(status, json={"error": error}))
    app = gateway_app(tmp_path, pool)
    with pytest.raises(openai.APIStatusError) as info:
        await openai_sdk(app).chat.completions.create(model="m", messages=MESSAGES,
                                                      stream=stream)
    assert info.value.status_code == status
    assert (info.value.code, info.value.param) == (error["code"], error["param"])
    assert error["message"] in info.value.message
    with pytest.raises(anthropic.APIStatusError) as anth:
        await anthropic_sdk(app).messages.create(model="m", max_tokens=9, messages=MESSAGES)
    assert anth.value.status_code == status
    message = anth.value.body["error"]["message"]  # type: ignore[index]
    assert error["message"] in message
    assert error["param"] is None or error["param"] in message
    app.state.store.close()
    await pool.aclose()


async def test_a_numeric_code_is_not_passed_on(tmp_path: Path) -> None:
    """vLLM's error `code` is the HTTP status, a number: the client's code stays the gateway's
    own (none for a plain 400), never a number where OpenAI's SDK expects text."""
    pool = pool_over_handler(lambda request: httpx.Response(400, json={"error": {
        "message": "bad", "type": "BadRequestError", "param": None, "code": 400}}))
    app = gateway_app(tmp_path, pool)
    with pytest.raises(openai.BadRequestError) as info:
        await openai_sdk(app).chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.code is None and info.value.param is None
    app.state.store.close()
    await pool.aclose()
