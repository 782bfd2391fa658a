"""The request path's cheap forms behave like the plain ones they replace: copy-on-write cache
breakpoints (vs a deep copy), plain-dict stats rows (vs ORM objects), bisected histogram
buckets (vs a naive scan), counter-based request ids, the valid-message fast path, the API
routes served past Starlette's router (vs the router)."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from gateway.backends.anthropic_format import place_cache_breakpoints
from gateway.errors import GatewayError
from gateway.metrics import Registry
from gateway.parse_openai import parse_chat
from gateway.request_state import new_request_id
from gateway.stats import RecordStore, RequestRecord
from gateway.validate import ParseContext

block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=4)},
    optional={"cache_control": st.just({"type": "ephemeral"})})
content = st.one_of(st.text(max_size=4), st.lists(block, max_size=3))
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                 "content": content})
tool = st.fixed_dictionaries({"name": st.text(min_size=1, max_size=3)},
                             optional={"cache_control": st.just({"type": "ephemeral"})})


@settings(max_examples=150, deadline=None)
@given(st.lists(message, min_size=1, max_size=5), st.one_of(st.none(), content),
       st.lists(tool, max_size=3))
def test_breakpoints_never_touch_the_callers_body(
    messages: list[Any], system: Any, tools: list[Any]
) -> None:
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 8}
    if system is not None:
        body["system"] = system
    if tools:
        body["tools"] = tools
    before = copy.deepcopy(body)
    out = place_cache_breakpoints(body)
    assert body == before  # the client's body is unchanged
    # only cache_control markers were added, and string content became one text block
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "cache_control"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    def as_blocks(b: dict[str, Any]) -> dict[str, Any]:
        b = copy.deepcopy(b)
        for container, key in [(b, "system")] + [(m, "content") for m in b["messages"]]:
            if isinstance(container.get(key), str) and container[key]:
                container[key] = [{"type": "text", "text": container[key]}]
        return strip(b)

    assert strip(as_blocks(out)) == as_blocks(before)
    marks = str(out).count("cache_control") - str(before).count("cache_control")
    assert 0 <= marks <= 4


def test_plain_rows_and_orm_records_store_alike(tmp_path: Path) -> None:
    store = RecordStore(f"sqlite:///{tmp_path / 's.db'}", batch_size=4, flush_interval_s=0.01)
    store.add(RequestRecord(request_id="orm", tenant="t", model="m", backend="b",
                            provider="openai", route="chat.completions", status=200))
    for i in range(10):
        store.add({"request_id": f"row{i}", "tenant": "t", "model": "m", "backend": "b",
                   "provider": "openai", "route": "chat.completions", "status": 200})
    with pytest.raises(ValueError, match="not RequestRecord columns"):
        store.add({"request_id": "x", "no_such_column": 1})
    store.close()
    store.add({"request_id": "late", "tenant": "t", "model": "m", "backend": "b",
               "provider": "openai", "route": "r", "status": 499})  # after close: still kept
    with store.session() as session:
        rows = list(session.scalars(select(RequestRecord).order_by(RequestRecord.id)))
    assert sorted(r.request_id for r in rows) == sorted(
        ["orm", "late", *(f"row{i}" for i in range(10))])
    for r in rows:  # column defaults apply to plain rows exactly as to ORM objects
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (0, 0, 0)
        assert (r.latency_ms, r.prefill_saved_ms, r.lint_ids, r.stream) == (0.0, 0.0, "", False)
        assert r.ts is not None and r.predicted_cached_tokens is None


@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from([0.005, 0.01, 1.0, 60.0])), max_size=30))
def test_histogram_buckets_match_a_naive_count(values: list[float]) -> None:
    hist = Registry().histogram("h", "h", ("k",))
    for v in values:
        hist.observe(v, k="a")
    if not values:
        assert hist.count(k="a") == 0
        return
    counts, total = hist.snapshot(k="a")
    for i, bound in enumerate(hist.buckets):
        assert counts[i] == sum(1 for v in values if v <= bound)
    # prometheus_client counts a NaN observation in no bucket (the sum still turns NaN).
    assert counts[-1] == sum(1 for v in values if not math.isnan(v))
    expected = sum(values)
    assert math.isnan(total) == math.isnan(expected)
    assert math.isnan(total) or total == expected


def test_counter_labels_are_checked() -> None:
    counter = Registry().counter("c", "c", ("a", "b"))
    counter.inc(a="x", b=3)  # type: ignore[arg-type]
    assert counter.get(a="x", b="3") == 1.0
    for bad in ({"a": "x"}, {"a": "x", "c": "y"}, {"a": "x", "b": "y", "c": "z"}):
        with pytest.raises(ValueError, match="takes labels"):
            counter.inc(**bad)


def test_request_ids_are_unique_24_hex_digits_that_count_nothing() -> None:
    """Unique, and consecutive ids say nothing of how many came between: their differences
    are not constant (a counter's are) and their digits are spread as random ones are."""
    ids = [new_request_id() for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids)
    steps = {int(b, 16) - int(a, 16) for a, b in zip(ids, ids[1:], strict=False)}
    assert len(steps) > 4900
    last_digits = [int(i[-1], 16) for i in ids]
    assert all(200 < last_digits.count(d) < 425 for d in range(16))  # 312.5 expected


_VALUES = st.sampled_from([None, "", "x", 3, [], {}, [{"type": "text", "text": "t"}], True])
_CALLS = st.lists(st.one_of(
    st.fixed_dictionaries({"id": st.just("c1"), "type": st.just("function"),
                           "function": st.fixed_dictionaries(
                               {"name": st.sampled_from(["f", 3, None])},
                               optional={"arguments": st.sampled_from(["{}", "", 4, None])})}),
    st.fixed_dictionaries({"function": _VALUES}), _VALUES), max_size=3)


@settings(max_examples=400, deadline=None)
@given(role=st.sampled_from(["assistant", "user", "tool", "system", "robot", 3]),
       content=_VALUES, calls=st.one_of(_CALLS, _VALUES),
       extra=st.sampled_from([{}, {"name": "n"}, {"name": 5}, {"tool_call_id": "t1"},
                              {"tool_call_id": ""}]))
def test_the_fast_message_check_accepts_what_the_full_check_accepts(
        role: Any, content: Any, calls: Any, extra: dict[str, Any]) -> None:
    """`message` takes common valid messages without the full check: it accepts exactly the
    messages `checked_message` accepts, and refuses the others with its error."""
    from gateway.openai_messages import checked_message, message

    msg = {"role": role, "content": content, "tool_calls": calls, **extra}
    try:
        expected: Any = checked_message(copy.deepcopy(msg), 1)
    except GatewayError as exc:
        expected = (exc.param, str(exc))
    try:
        got: Any = message(msg, 1)
    except GatewayError as exc:
        got = (exc.param, str(exc))
    assert got == expected


@pytest.mark.parametrize("msg, field", [
    ({"role": "user", "content": 3}, "messages[1].content"),
    ({"role": "user", "content": "hi", "name": 5}, "messages[1].name"),
    ({"role": "robot", "content": "hi"}, "messages[1].role"),
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {}}]},
     "messages[1].tool_calls[0].function"),
    ("not a message", "messages[1]"),
])
def test_invalid_messages_still_name_the_field(msg: Any, field: str) -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, msg]}
    with pytest.raises(GatewayError) as err:
        parse_chat(body, ParseContext("r", "t", ("*",)))
    assert err.value.param == field


async def test_api_routes_answer_as_the_router_would(make_fake_app: Any) -> None:
    """The three POST API routes are served from the app's own ASGI call, past Starlette's
    middleware and router: every answer (a reply, a 400, another format, a stream) equals the
    one the router gives, and other methods and paths still go through the router."""
    import httpx
    from starlette.applications import Starlette

    from .gateway_fakes import FAKE_MODEL

    app = make_fake_app(lint_mode="report")
    through_router: list[str] = []
    router_stack = app.router.middleware_stack

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        through_router.append(scope["method"])
        await router_stack(scope, receive, send)

    app.router.middleware_stack = counted

    async def routed(scope: Any, receive: Any, send: Any) -> None:
        await Starlette.__call__(app, scope, receive, send)

    chat = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello there"}]}
    calls = [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
             ("/v1/chat/completions", {"model": FAKE_MODEL, "messages": []}),
             ("/v1/completions", {"model": FAKE_MODEL, "prompt": "once upon"}),
             ("/v1/messages", {"model": FAKE_MODEL, "max_tokens": 8, "messages": [
                 {"role": "user", "content": "hi"}]}),
             ("/v1/messages", {"model": FAKE_MODEL, "messages": "nope"})]

    def same(response: httpx.Response) -> tuple[Any, ...]:
        text = response.text
        for noisy in ("id", "created", "request_id"):  # fresh per request
            text = re.sub(rf'"{noisy}":\s*("[^"]*"|\d+)', f'"{noisy}":_', text)
        headers = {k: v for k, v in response.headers.items()
                   if k.startswith("x-prefixgate") or k == "content-type"}
        return response.status_code, headers, text

    answers, routed_methods = {}, {}
    for name, asgi in (("fast", app), ("routed", routed)):
        through_router.clear()
        transport = httpx.ASGITransport(app=asgi, root_path="/gw")
        async with httpx.AsyncClient(transport=transport, base_url="http://t/gw") as http:
            answers[name] = [same(await http.post(path, json=body)) for path, body in calls]
            wrong_method = await http.get("/v1/chat/completions")
            assert wrong_method.status_code == 405
            assert wrong_method.json()["error"]["type"] == "invalid_request_error"
        routed_methods[name] = list(through_router)
    assert answers["fast"] == answers["routed"]
    assert routed_methods == {"fast": ["GET"], "routed": ["POST"] * len(calls) + ["GET"]}
    assert [a[0] for a in answers["fast"]] == [200, 200, 400, 200, 200, 400]


def test_a_legacy_completion_is_served_unlinted_without_an_error_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """A /v1/completions body has a prompt, not messages: nothing for prompt_lint to lay out,
    and no failure to log on every such request."""
    from gateway.lint_stage import LintStage

    body = {"model": "m", "prompt": "once upon a time"}
    outcome = LintStage().run(body, "openai", "t", "report")
    assert outcome.body is body and outcome.lint_ids == () and not outcome.changed
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
