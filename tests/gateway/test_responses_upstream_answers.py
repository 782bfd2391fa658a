"""POST /v1/responses answers from upstreams, through the official openai SDK: function
calls, reasoning, refusals, cut and failed answers.

Independent references: the SDK's own models, its stream helper (whose accumulation checks the
event sequence) and strict validation against its `ResponseStreamEvent` / `Response` types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from .test_responses_upstream import TOOLS, sdk
from .upstream_helpers import fake_replicas, gateway_app, pool_over, pool_over_handler, records


def sse(chunks: list[dict[str, Any]]) -> httpx.Response:
    """An OpenAI chat completions event stream of `chunks`, then `[DONE]`."""
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=text.encode())


USAGE = {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
         "prompt_tokens_details": {"cached_tokens": 16}}


def calling(text: str, finish: str = "tool_calls") -> Any:
    """An upstream answering with `text` and two calls (streamed: each call's arguments in
    two pieces), finish reason `finish`."""
    args = ['{"city":"Paris"}', '{"city":"Oslo"}']

    def handler(request: httpx.Request) -> httpx.Response:
        calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": "get_weather", "arguments": a}}
                 for i, a in enumerate(args)]
        if not json.loads(request.content).get("stream"):
            return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text or None,
                                        "tool_calls": calls},
                "finish_reason": finish}], "usage": USAGE})
        chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"content": text},
                                                      "finish_reason": None}]}]
        for i, a in enumerate(args):
            head = {"index": i, "id": f"call_{i}", "type": "function",
                    "function": {"name": "get_weather", "arguments": a[:5]}}
            tail = {"index": i, "function": {"arguments": a[5:]}}
            chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [p]},
                                     "finish_reason": None}]} for p in (head, tail)]
        chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                   {"choices": [], "usage": USAGE}]
        return sse(chunks)
    return handler


@pytest.mark.parametrize("stream", [False, True])
async def test_function_calls_come_back_as_function_call_items(tmp_path: Path,
                                                              stream: bool) -> None:
    """An upstream's text and tool calls: a message item then one function_call item per
    call, the call ids the upstream's (what the client sends back as call_id), arguments
    whole; streamed, the SDK's stream helper rebuilds the same output from the events."""
    pool = pool_over_handler(calling("Checking both."))
    app = gateway_app(tmp_path, pool)
    client = sdk(app)
    kwargs: dict[str, Any] = {"model": "m", "input": "Paris and Oslo?", "tools": TOOLS}
    if stream:
        async with client.responses.stream(**kwargs) as events:
            kinds = [e.type async for e in events]
            answer = await events.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds.count("response.function_call_arguments.delta") == 4
        assert kinds.count("response.output_item.done") == 3
        assert kinds[-1] == "response.completed"
    else:
        answer = await client.responses.create(**kwargs)
    assert answer.status == "completed" and answer.output_text == "Checking both."
    calls = [item for item in answer.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_0", "get_weather", {"city": "Paris"}), ("call_1", "get_weather", {"city": "Oslo"})]
    assert [item.type for item in answer.output] == ["message", "function_call", "function_call"]
    assert len({item.id for item in answer.output}) == 3
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens == 16
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (30, 12)
    app.state.store.close()
    await pool.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_cut_by_max_output_tokens_is_incomplete(tmp_path: Path,
                                                               stream: bool) -> None:
    pool = pool_over_handler(calling("Partial", finish="length"))
    app = gateway_app(tmp_path, pool)
    client = sdk(app)
    kwargs: dict[str, Any] = {"model": "m", "input": "Go", "max_output_tokens": 16}
    if stream:
        events = [e async for e in await client.responses.create(**kwargs, stream=True)]
        assert events[-1].type == "response.incomplete"
        answer = events[-1].response  # type: ignore[union-attr]
        assert [e.sequence_number for e in events] == list(range(len(events)))
    else:
        answer = await client.responses.create(**kwargs)
    assert answer.status == "incomplete"
    assert answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output[0].type == "message" and answer.output[0].status == "incomplete"
    app.state.store.close()
    await pool.aclose()


async def test_a_stream_cut_upstream_ends_in_response_failed(tmp_path: Path) -> None:
    """A replica whose stream stops mid-way: the client's last event is `response.failed`
    with the error, never a `response.completed`; the record says 502."""
    replicas = fake_replicas(1, cut_after=2)
    pool = pool_over(replicas)
    app = gateway_app(tmp_path, pool)
    events = [e async for e in await sdk(app).responses.create(
        model="fake", input="Go on", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
    assert "response.completed" not in kinds
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None and failed.error.message
    assert [r.status for r in records(app)] == [502]
    app.state.store.close()
    await pool.aclose()

def thinking(request: httpx.Request) -> httpx.Response:
    """A reasoning model's answer (vLLM's `reasoning_content`), whole or streamed."""
    if not json.loads(request.content).get("stream"):
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "Answer.",
                                    "reasoning_content": "Think more."},
            "finish_reason": "stop"}], "usage": USAGE})
    deltas = [{"reasoning_content": "Think "}, {"reasoning_content": "more."},
              {"content": "Answer."}]
    return sse([{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
               + [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": USAGE}])


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_comes_back_as_a_reasoning_item(tmp_path: Path, stream: bool) -> None:
    """A reasoning upstream's reasoning is a `reasoning` item (one `reasoning_text` part)
    before the message; streamed as `response.reasoning_text.delta` events."""
    pool = pool_over_handler(thinking)
    app = gateway_app(tmp_path, pool)
    client = sdk(app)
    if stream:
        async with client.responses.stream(model="m", input="Why?") as events:
            deltas = [e.delta async for e in events if e.type == "response.reasoning_text.delta"]
            answer = await events.get_final_response()
        assert deltas == ["Think ", "more."]
    else:
        answer = await client.responses.create(model="m", input="Why?")
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    reasoning = answer.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["Think more."]
    assert answer.output_text == "Answer."
    app.state.store.close()
    await pool.aclose()


def refusing(request: httpx.Request) -> httpx.Response:
    """A structured answer the model refused (OpenAI's `refusal`, content null)."""
    if not json.loads(request.content).get("stream"):
        return httpx.Response(200, json={"id": "u", "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": None,
                                    "refusal": "I can't help."},
            "finish_reason": "stop"}], "usage": USAGE})
    return sse([{"choices": [{"index": 0, "delta": {"refusal": "I can't help."},
                              "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"choices": [], "usage": USAGE}])


STREAM_EVENT: Any = TypeAdapter(ResponseStreamEvent)


@pytest.mark.parametrize("handler", [thinking, refusing, calling("Both."), calling("", "length")],
                         ids=["reasoning", "refusal", "calls", "calls-cut"])
async def test_upstream_answers_validate_against_the_sdk_types(tmp_path: Path,
                                                               handler: Any) -> None:
    """Each streamed event validates as one of the SDK's `ResponseStreamEvent` types, the
    whole answer as its `Response`, and both hold the same output items."""
    pool = pool_over_handler(handler)
    app = gateway_app(tmp_path, pool)
    body = {"model": "m", "input": "Go", "tools": TOOLS}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        whole = Response.model_validate((await http.post("/v1/responses", json=body)).json())
        streamed = await http.post("/v1/responses", json={**body, "stream": True})
    events = [STREAM_EVENT.validate_python(json.loads(block.split("data: ", 1)[1]))
              for block in streamed.text.strip().split("\n\n")]
    last = events[-1].response
    assert last.status == whole.status
    assert [i.model_dump(exclude={"id"}) for i in last.output] == \
        [i.model_dump(exclude={"id"}) for i in whole.output]
    assert last.usage == whole.usage
    if handler is refusing:
        assert [(c.type, c.refusal) for c in whole.output[0].content] == [  # type: ignore
            ("refusal", "I can't help.")]
    app.state.store.close()
    await pool.aclose()
