"""The official anthropic SDK against /v1/messages over the deterministic fake backend."""

from __future__ import annotations

import anthropic
import httpx2
import pytest

from gateway.errors import GatewayError
from gateway.parse_anthropic import parse_messages
from gateway.validate import ParseContext
from tests.support import serve

from .gateway_fakes import FAKE_MODEL, FAKE_PAGE, FakeBackend, asgi_client, words_of

SYSTEM_BLOCKS = [
    {"type": "text", "text": "You are a careful assistant. " * 4},
    {"type": "text", "text": "Reply briefly.", "cache_control": {"type": "ephemeral"}},
]
TOOLS = [{"name": "lookup", "description": "Look a word up",
          "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}}}]


def async_sdk(app, key: str = "none") -> anthropic.AsyncAnthropic:
    # The anthropic SDK runs on httpx2, so its in-process transport comes from there.
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway")
    return anthropic.AsyncAnthropic(base_url="http://gateway", api_key=key, http_client=http,
                                    max_retries=0)


def reference_prompt_words(body: dict) -> int:
    return len(words_of(parse_messages(body, ParseContext("x", "default", (FAKE_MODEL,)))))


async def test_messages_round_trip_usage_is_anthropic_shaped(make_fake_app):
    client = async_sdk(make_fake_app())
    body = {"model": FAKE_MODEL, "max_tokens": 16, "system": SYSTEM_BLOCKS,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi you"}]}]}
    one = await client.messages.create(**body)
    two = await client.messages.with_raw_response.create(**body)
    msg = await two.parse()
    assert one.content[0].text == "echo: hi you" and one.stop_reason == "end_turn"
    n = reference_prompt_words(body)
    cached = (n // FAKE_PAGE) * FAKE_PAGE
    assert one.usage.cache_read_input_tokens == 0 and one.usage.input_tokens == n
    assert msg.usage.cache_read_input_tokens == cached > 0
    assert msg.usage.input_tokens == n - cached  # the uncached part only
    assert msg.usage.cache_creation_input_tokens == 0
    assert int(two.headers["x-prefixgate-cached-tokens"]) == cached


async def test_streaming_events(make_fake_app):
    client = async_sdk(make_fake_app())
    body = {"model": FAKE_MODEL, "max_tokens": 3, "system": "Be short.",
            "messages": [{"role": "user", "content": "a b c d"}]}
    async with client.messages.stream(**body) as stream:
        events = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(events)
    assert final.content[0].text == "echo: a b"
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3


async def test_tool_use_round_trip(make_fake_app, fake_backend: FakeBackend):
    client = async_sdk(make_fake_app())
    messages = [{"role": "user", "content": 'CALL lookup {"word": "cache"}'}]
    out = await client.messages.create(model=FAKE_MODEL, max_tokens=32, tools=TOOLS,
                                       messages=messages)
    assert out.stop_reason == "tool_use"
    tool = [b for b in out.content if b.type == "tool_use"][0]
    assert (tool.name, tool.input) == ("lookup", {"word": "cache"})
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool.id, "content": "a fast store"}]},
    ]
    again = await client.messages.create(model=FAKE_MODEL, max_tokens=32, tools=TOOLS,
                                         messages=messages)
    assert again.content[0].text == "echo: a fast store"
    seen = fake_backend.seen[-1]
    assert seen.messages[1]["tool_calls"][0]["id"] == tool.id
    assert seen.messages[2] == {"role": "tool", "tool_call_id": tool.id,
                                "content": "a fast store"}


async def test_text_blocks_reach_the_model_one_a_line(make_fake_app,
                                                      fake_backend: FakeBackend) -> None:
    """Several text blocks of a message are joined one a line (a client's reminder block and
    its question do not run together as 'wrote.The cat'), in user, tool_result and
    assistant content alike."""
    blocks = [{"type": "text", "text": "Repeat exactly what I wrote."},
              {"type": "text", "text": "The cat sat."}]
    client = async_sdk(make_fake_app())
    await client.messages.create(model=FAKE_MODEL, max_tokens=8, messages=[
        {"role": "user", "content": blocks},
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": [{"type": "text", "text": "Again."}]}])
    seen = fake_backend.seen[-1].messages
    expected = "\n".join(b["text"] for b in blocks)
    assert [m["content"] for m in seen] == [expected, expected, "Again."]


def _uses(*ids: str) -> dict:
    return {"role": "assistant", "content": [
        {"type": "tool_use", "id": i, "name": "lookup", "input": {"word": "x"}} for i in ids]}


def _results(*ids: str, text: str | None = None) -> dict:
    blocks = [{"type": "tool_result", "tool_use_id": i, "content": "found"} for i in ids]
    return {"role": "user", "content": blocks + ([{"type": "text", "text": text}] if text else [])}


ASK = {"role": "user", "content": "look up x and y"}


@pytest.mark.parametrize(("history", "field"), [
    ([ASK, _uses("t1"), _results("zz")], "messages[2].content"),
    ([ASK, _uses("t1", "t2"), _results("t1", text="and?")], "messages[1].content"),
    ([ASK, _uses("t1", "t2"), _results("t1")], "messages[1].content"),
    ([ASK, _uses("t1"), ASK], "messages[1].content"),
    ([ASK, _uses("t1"), _results("t1"), _uses("t2"), _results("t1")], "messages[4].content"),
    ([_results("t1")], "messages[0].content")])
async def test_broken_tool_round_trips_are_refused(make_fake_app, history, field):
    """Anthropic's rule: each tool_result answers a tool_use block of the previous message and
    each tool_use is answered in the next one. Both breaks were served (results are rendered
    by position, so the model read one as another call's answer): an Anthropic 400 naming the
    message; closed round trips, in any block order, are served."""
    async with asgi_client(make_fake_app()) as http:
        for history_, ok in [(history, False),
                             ([ASK, _uses("t1", "t2"), _results("t2", "t1", text="go")], True),
                             ([ASK, _uses("t1"), _results("t1")], True)]:
            body = {"model": FAKE_MODEL, "max_tokens": 8, "tools": TOOLS, "messages": history_}
            response = await http.post("/v1/messages", json=body)
            if ok:
                assert response.status_code == 200, response.text
                continue
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and field in error["message"]


async def test_streamed_tool_use(make_fake_app):
    client = async_sdk(make_fake_app())
    async with client.messages.stream(
        model=FAKE_MODEL, max_tokens=32, tools=TOOLS,
        messages=[{"role": "user", "content": 'CALL lookup {"word": "page"}'}],
    ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"word": "page"}


def test_sync_sdk_over_a_real_socket(make_fake_app):
    with serve(make_fake_app()) as server:
        with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0) as client:
            out = client.messages.create(model=FAKE_MODEL, max_tokens=8,
                                         messages=[{"role": "user", "content": "socket"}])
            assert out.content[0].text == "echo: socket"
            with client.messages.stream(model=FAKE_MODEL, max_tokens=8,
                                        messages=[{"role": "user", "content": "x y"}]) as stream:
                text = "".join(stream.text_stream)
        assert text == "echo: x y"


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"model": FAKE_MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"model": "claude-nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
     404, "model"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
     400, "messages[0].role"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "temperature": 1.5,
      "messages": [{"role": "user", "content": "x"}]}, 400, "temperature"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "system": 7,
      "messages": [{"role": "user", "content": "x"}]}, 400, "system"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "messages[0].content[0]"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": []}]},
     400, "messages[0].content"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": ""}]},
     400, "messages[0].content"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": []},
        {"role": "user", "content": "y"}]}, 400, "messages[1].content"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "tools": [{"name": "lookup"}],
      "messages": [{"role": "user", "content": "x"}]}, 400, "tools[0].input_schema"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "tools": [{"name": "lookup", "input_schema": None}],
      "messages": [{"role": "user", "content": "x"}]}, 400, "tools[0].input_schema"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "top_k": 0,
      "messages": [{"role": "user", "content": "x"}]}, 400, "top_k"),
    ({"model": FAKE_MODEL, "max_tokens": 5, "stop_sequences": "x",
      "messages": [{"role": "user", "content": "x"}]}, 400, "stop_sequences"),
])
async def test_bad_input_is_an_anthropic_error(make_fake_app, body, status, field):
    async with asgi_client(make_fake_app()) as http:
        response = await http.post("/v1/messages", json=body)
        assert response.status_code == status
        data = response.json()
        assert data["type"] == "error"
        assert field in data["error"]["message"]
        assert data["error"]["type"] in {"invalid_request_error", "not_found_error"}


@pytest.mark.parametrize("block", [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a"}}])
async def test_blocks_the_model_cannot_read_are_named(make_fake_app, block):
    """An image or a document (in a message or a tool_result) is a 400 that says only text is
    supported and names the block's type (it said only 'must be a text block')."""
    tool_turns = [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [block]}]}]
    async with asgi_client(make_fake_app()) as http:
        for messages, path in [([{"role": "user", "content": [block]}], "messages[0].content[0]"),
                               ([{"role": "user", "content": "x"}, *tool_turns],
                                "messages[2].content[0].content[0]")]:
            response = await http.post("/v1/messages", json={
                "model": FAKE_MODEL, "max_tokens": 5, "tools": TOOLS, "messages": messages})
            assert response.status_code == 400
            message = response.json()["error"]["message"]
            assert path in message and "only text" in message and repr(block["type"]) in message


async def test_top_k_reaches_the_backend(make_fake_app, fake_backend: FakeBackend):
    client = async_sdk(make_fake_app())
    for top_k, expected in ((1, 1), (40, 40), (None, None)):
        await client.messages.create(model=FAKE_MODEL, max_tokens=4, extra_body={"top_k": top_k},
                                     messages=[{"role": "user", "content": "x"}])
        assert fake_backend.seen[-1].options.top_k == expected


async def test_a_final_assistant_message_may_be_empty(make_fake_app):
    """Anthropic's rule: every message has content, except an optional final assistant one
    (the prefill of the answer)."""
    client = async_sdk(make_fake_app())
    for empty in ("", []):
        out = await client.messages.create(
            model=FAKE_MODEL, max_tokens=8, stop_sequences=["zz"],
            messages=[{"role": "user", "content": "a b"}, {"role": "assistant", "content": empty}])
        assert out.content[0].text == "echo: a b"


async def test_sdk_raises_typed_errors(make_fake_app):
    client = async_sdk(make_fake_app())
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.messages.create(model=FAKE_MODEL, max_tokens=5,
                                     extra_body={"temperature": 1.7},
                                     messages=[{"role": "user", "content": "x"}])
    assert "temperature" in str(err.value)


async def test_unknown_model_is_anthropics_not_found_error(make_fake_app):
    """Anthropic's shape for an unknown model stays its own: 404 with not_found_error."""
    client = async_sdk(make_fake_app())
    with pytest.raises(anthropic.NotFoundError) as err:
        await client.messages.create(model="claude-nope", max_tokens=5,
                                     messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 404
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in err.value.body["error"]["message"]


async def test_a_prefill_ending_in_whitespace_is_anthropics_400(make_fake_app):
    """Anthropic refuses a final assistant message whose text ends with whitespace ("final
    assistant content cannot end with trailing whitespace"); as a string or as its last text
    block. Before, the gateway served it. Whitespace inside it, or ending an earlier
    assistant message, is fine."""
    client = async_sdk(make_fake_app())
    user = {"role": "user", "content": "a b"}
    for prefill in ("The answer is ", [{"type": "text", "text": "x"},
                                       {"type": "text", "text": "The answer is\n"}]):
        with pytest.raises(anthropic.BadRequestError) as err:
            await client.messages.create(model=FAKE_MODEL, max_tokens=8, messages=[
                user, {"role": "assistant", "content": prefill}])
        assert "trailing whitespace" in err.value.body["error"]["message"]
    served = await client.messages.create(model=FAKE_MODEL, max_tokens=8, messages=[
        user, {"role": "assistant", "content": "ok \n"}, user,
        {"role": "assistant", "content": "The answer is"}])
    assert served.stop_reason is not None


def test_a_prefill_cannot_start_a_json_document():
    """`output_config.format` makes the whole answer one JSON document, which a prefill's text
    would start outside the grammar: a 400 naming the message (before: served, the document
    after the prefill). The same prefill without a format is served."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"model": FAKE_MODEL, "max_tokens": 8, "output_config": {
        "format": {"type": "json_schema", "schema": schema}},
        "messages": [{"role": "user", "content": "a b"},
                     {"role": "assistant", "content": "{\"a\":"}]}
    ctx = ParseContext("x", "default", (FAKE_MODEL,))
    with pytest.raises(GatewayError) as err:
        parse_messages(body, ctx)
    assert err.value.status == 400 and err.value.param == "messages[1]"
    del body["output_config"]
    assert parse_messages(body, ctx).messages[-1]["content"] == "{\"a\":"


async def test_models_are_listed_in_anthropics_shape(make_fake_app):
    """The Anthropic SDK's models.list / retrieve get Anthropic's model objects (type
    "model", display_name, created_at) and page fields (before: OpenAI's cards, so each of
    those read None), and an unknown model is Anthropic's not_found_error. The OpenAI SDK
    still gets OpenAI's cards."""
    app = make_fake_app()
    client = async_sdk(app)
    page = await client.models.list()
    assert [(m.type, m.id, m.display_name) for m in page.data] == [
        ("model", FAKE_MODEL, FAKE_MODEL)]
    assert page.data[0].created_at.year == 1970
    assert (page.has_more, page.first_id, page.last_id) == (False, FAKE_MODEL, FAKE_MODEL)
    assert [m.id async for m in client.models.list()] == [FAKE_MODEL]
    one = await client.models.retrieve(FAKE_MODEL)
    assert (one.type, one.id, one.display_name) == ("model", FAKE_MODEL, FAKE_MODEL)
    with pytest.raises(anthropic.NotFoundError) as err:
        await client.models.retrieve("claude-nope")
    assert err.value.body["error"]["type"] == "not_found_error"
    async with asgi_client(app) as http:
        cards = (await http.get("/v1/models")).json()
    assert cards["object"] == "list" and cards["data"][0]["object"] == "model"


@pytest.mark.parametrize(("change", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "text", "text": "b"}, {"type": "text", "text": ""}]},
        {"role": "user", "content": "c"}]}, "messages[1].content[1].text"),
    ({"tools": [TOOLS[0], {**TOOLS[0], "description": "again"}]}, "tools"),
    ({"tools": [{**TOOLS[0], "name": "caldav.list-events"}]}, "tools[0].name"),
])
def test_empty_text_blocks_and_twice_named_tools_are_anthropics_400(change, param):
    """Anthropic refuses an empty text block in a message ("text content blocks must be
    non-empty"), two tools of one name ("Tool names must be unique") and a tool name outside
    ^[a-zA-Z0-9_-]{1,128}$ (an MCP tool's dotted name); before, the gateway served them (the
    engine's prompt then listed one tool twice)."""
    body = {"model": FAKE_MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": "a b"}], **change}
    with pytest.raises(GatewayError) as err:
        parse_messages(body, ParseContext("x", "default", (FAKE_MODEL,)))
    assert (err.value.status, err.value.param) == (400, param)


def test_consecutive_turns_of_one_role_are_one_turn():
    """Anthropic combines consecutive user (or assistant) messages into a single turn; the
    gateway gives the model the same conversation as the one-turn form of the body (before:
    two turns of one role, a conversation the client never meant)."""
    ctx = ParseContext("x", "default", (FAKE_MODEL,))
    call = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"word": "a"}}

    def neutral(messages: list) -> tuple:
        return parse_messages({"model": FAKE_MODEL, "max_tokens": 8, "tools": TOOLS,
                               "messages": messages}, ctx).messages

    split = neutral([
        {"role": "user", "content": "first"}, {"role": "user", "content": "second"},
        {"role": "assistant", "content": "thinking aloud"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]},
        {"role": "user", "content": [{"type": "text", "text": "go on"}]}])
    whole = neutral([
        {"role": "user", "content": [{"type": "text", "text": "first"},
                                     {"type": "text", "text": "second"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "thinking aloud"}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"},
                                     {"type": "text", "text": "go on"}]}])
    assert split == whole
    assert [m["role"] for m in whole] == ["user", "assistant", "tool", "user"]
