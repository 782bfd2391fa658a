"""Single rules, cross-request checks, the learner's bounds, and the rewriter's edges."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from prompt_lint import (
    RULES,
    RequestError,
    SessionTracker,
    TemplateLearner,
    detect_provider,
    lint_request,
    request_tokens,
    rewrite_request,
)
from prompt_lint.media import MEDIA_TOKENS
from prompt_lint.providers import segments
from prompt_lint.tokens import get_encoding

BACKGROUND = "\n".join(f"Guideline {i}: keep answers about topic {i} short and exact."
                       for i in range(150))


def oa_tool(name: str, **extra: Any) -> dict[str, Any]:
    params = {"type": "object", "properties": {"q": {"type": "string"}}, **extra}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": params}}


def an_tool(name: str) -> dict[str, Any]:
    return {"name": name, "description": f"{name} tool",
            "input_schema": {"properties": {"q": {"type": "string"}}, "type": "object"}}


def openai(system: str, tools: list[dict[str, Any]] | None = None,
           history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, *(history or [])]
    if not history:
        messages.append({"role": "user", "content": "hello"})
    return {"model": "gpt-4o", "tools": tools or [], "messages": messages}


def anthropic(system: Any, model: str = "claude-sonnet-4-5",
              tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"model": model, "max_tokens": 100, "system": system, "tools": tools or [],
            "messages": [{"role": "user", "content": "hello"}]}


def rules(body: dict[str, Any], **kwargs: Any) -> list[str]:
    return [f.rule for f in lint_request(body, **kwargs).findings]


def test_registry_ids_are_stable_and_complete() -> None:
    assert list(RULES) == [f"PL{i:03d}" for i in range(1, 15)]
    assert all(r.explanation and r.fix and r.kind for r in RULES.values())


def test_detect_provider() -> None:
    assert detect_provider(openai("x")) == "openai"
    assert detect_provider(anthropic("x")) == "anthropic"
    assert detect_provider({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]}) == "anthropic"
    assert detect_provider({"messages": [{"role": "user", "content": "hi"}],
                            "tools": [an_tool("a")]}) == "anthropic"


@pytest.mark.parametrize("body", [[], {"messages": []}, {"messages": [{"role": "robot"}]},
                                  {"messages": [{"role": "user", "content": 5}]},
                                  {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}])
def test_bad_requests_raise(body: Any) -> None:
    with pytest.raises(RequestError):
        lint_request(body, provider="openai")


def test_token_counts_and_offsets_follow_tiktoken() -> None:
    body = openai(BACKGROUND + "\nCurrent time: 2026-11-29T14:03:07Z\nBe brief.",
                  [oa_tool("b"), oa_tool("a")])
    report = lint_request(body)
    encoding = get_encoding()
    # the layout tokenizes each segment (tool, message header, content) on its own
    reference = [t for s in segments(body, "openai") for t in encoding.encode_ordinary(s.text)]
    assert report.prompt_tokens == len(reference)
    assert request_tokens(body) == reference
    (ts,) = [f for f in report.findings if f.rule == "PL001"]
    assert report.cacheable_tokens == ts.token_offset
    before = encoding.decode(request_tokens(body)[: ts.token_offset])
    assert before.endswith("Current time:") or before.endswith("Current time: ")
    assert report.cacheable_tokens < report.cacheable_tokens_after_fix <= report.prompt_tokens


def test_tool_order_and_json_changes_within_a_family() -> None:
    learner = TemplateLearner()
    first = openai(BACKGROUND, [oa_tool("a"), oa_tool("b"), oa_tool("c")])
    assert "PL004" not in rules(first, learner=learner)
    swapped = openai(BACKGROUND, [oa_tool("a"), oa_tool("c"), oa_tool("b")])
    report = lint_request(swapped, learner=learner)
    order = [f for f in report.findings if f.rule == "PL004"]
    assert len(order) == 1
    assert order[0].token_offset == report.cacheable_tokens > 0  # tools[1] moved, tools[0] kept
    assert report.cacheable_tokens_after_fix > report.cacheable_tokens
    reordered = copy.deepcopy(swapped)
    params = reordered["tools"][1]["function"]["parameters"]
    reordered["tools"][1]["function"]["parameters"] = dict(reversed(list(params.items())))
    found = lint_request(reordered, learner=learner)
    assert [f.message for f in found.findings if f.rule == "PL006"] == \
        ["tool 'c' JSON changed (key order)"]
    edited = copy.deepcopy(reordered)
    edited["tools"][1]["function"]["description"] = "c tool, now better"
    found = lint_request(edited, learner=learner)
    assert [f.message for f in found.findings if f.rule == "PL006"] == \
        ["tool 'c' JSON changed (content)"]
    assert found.cacheable_tokens_after_fix == found.cacheable_tokens  # a rewrite cannot help


def test_unsorted_tools_are_info() -> None:
    report = lint_request(openai("x", [oa_tool("b"), oa_tool("a")]))
    assert {(f.rule, f.severity) for f in report.findings} == {("PL005", "info"),
                                                               ("PL007", "info")}


def test_history_must_be_append_only() -> None:
    learner = TemplateLearner()
    turn1 = [{"role": "user", "content": "plan the deploy"},
             {"role": "assistant", "content": "step one"}, {"role": "user", "content": "go"}]
    assert "PL009" not in rules(openai(BACKGROUND, history=turn1), learner=learner)
    turn2 = copy.deepcopy(turn1) + [{"role": "assistant", "content": "done"},
                                    {"role": "user", "content": "next"}]
    assert "PL009" not in rules(openai(BACKGROUND, history=turn2), learner=learner)
    edited = copy.deepcopy(turn2) + [{"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "y"}]
    edited[1]["content"] = "step one (summarised)"
    found = [f for f in lint_request(openai(BACKGROUND, history=edited), learner=learner).findings
             if f.rule == "PL009"]
    assert [f.path for f in found] == ["messages[2]"]


def test_a_new_conversation_that_opens_like_the_last_is_no_history_edit() -> None:
    """Two conversations of one agent that open with the same task share a session key; the
    second one's first request sends a prefix of what the first one sent last (nothing it
    sends is uncached), so it is no PL009, and an edit after it still is."""
    learner = TemplateLearner()
    opening = {"role": "user", "content": "why does test_login fail?"}
    long = [opening, {"role": "assistant", "content": "reading auth.py"},
            {"role": "user", "content": "and now?"}]
    assert "PL009" not in rules(openai(BACKGROUND, history=long), learner=learner)
    restart = [copy.deepcopy(opening)]
    assert long[:len(restart)] == restart  # the reference: a prefix of the previous history
    assert "PL009" not in rules(openai(BACKGROUND, history=restart), learner=learner)
    edited = [copy.deepcopy(opening), {"role": "assistant", "content": "something else"},
              {"role": "user", "content": "next"}]
    grown = rules(openai(BACKGROUND, history=edited), learner=learner)
    assert "PL009" not in grown  # appends to the restart: append-only
    edited[1]["content"] = "changed"
    found = [f.path for f in lint_request(openai(BACKGROUND, history=edited),
                                          learner=learner).findings if f.rule == "PL009"]
    assert found == ["messages[2]"]


def test_explicit_sessions_are_kept_apart() -> None:
    tracker = SessionTracker()
    a = openai("x", history=[{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "A"},
                             {"role": "user", "content": "more"}])
    b = copy.deepcopy(a)
    b["messages"][2]["content"] = "B"
    assert "PL009" not in rules(a, session=tracker)
    assert "PL009" in rules(b, session=tracker)  # same auto key: looks edited
    learner = TemplateLearner()
    assert "PL009" not in rules(a, learner=learner, session="conv-a")
    assert "PL009" not in rules(b, learner=learner, session="conv-b")


def test_short_stable_prefix_against_provider_minimum() -> None:
    body = openai("Current time: 2026-11-29T14:03:07Z\n" + BACKGROUND)
    report = lint_request(body)
    assert report.prompt_tokens >= 1024 > report.cacheable_tokens
    assert "PL010" in [f.rule for f in report.findings]
    assert "PL010" not in rules(openai(BACKGROUND + "\nCurrent time: 2026-11-29T14:03:07Z"))
    assert "PL010" not in rules(openai("Current time: 2026-11-29T14:03:07Z"))  # short prompt


def test_anthropic_minimum_depends_on_model() -> None:
    system = BACKGROUND[: len(BACKGROUND) * 3 // 5]
    sonnet = lint_request(anthropic(system))
    assert 1024 <= sonnet.prompt_tokens < 2048
    assert "PL011" in [f.rule for f in sonnet.findings]
    assert "PL011" not in rules(anthropic(system, model="claude-3-5-haiku-latest"))


def test_cache_control_misplaced() -> None:
    block = {"type": "text", "text": BACKGROUND, "cache_control": {"type": "ephemeral"}}
    assert rules(anthropic([block])) == []
    dynamic = dict(block, text="Current time: 2026-11-29T14:03:07Z\n" + BACKGROUND)
    found = lint_request(anthropic([dynamic])).findings
    assert "PL012" in [f.rule for f in found]
    early = [{"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}},
             {"type": "text", "text": BACKGROUND}]
    assert [f.path for f in lint_request(anthropic(early)).findings if f.rule == "PL012"] == \
        ["system[0]"]
    many = [dict(block, text=f"part {i}\n" + BACKGROUND[:500]) for i in range(5)] + [block]
    assert any("breakpoints" in f.message for f in lint_request(anthropic(many)).findings)


def test_learner_memory_is_bounded() -> None:
    learner = TemplateLearner(max_families=3)
    for k in range(10):
        system = "\n".join(f"Family {k} rule {i}: {'xyz' * k} do task {i * k}." for i in range(20))
        lint_request(openai(system), learner=learner)
    assert len(learner.families) == 3
    live = set(learner.families)
    assert all(owners <= live for owners in learner.index.lines.values())
    with pytest.raises(ValueError):
        TemplateLearner(max_families=0)


def test_learned_span_without_pattern() -> None:
    learner = TemplateLearner()
    found = []
    for weather in ["sunny", "light rain", "sunny", "fog"]:
        report = lint_request(openai(BACKGROUND + f"\nWeather now: {weather}.\nBe brief."),
                              learner=learner)
        found.append([f.value for f in report.findings if f.rule == "PL008"])
    assert found == [[], ["light rain"], ["sunny"], ["fog"]]
    assert len({r for r in [report.family]}) == 1


def test_anthropic_rewrite_keeps_tool_results_first_and_breakpoint_on_last_tool() -> None:
    tools = [an_tool("zeta"), dict(an_tool("alpha"), cache_control={"type": "ephemeral"})]
    body = anthropic("You help.\nuser_id: u_12345", tools=tools)
    body["messages"] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "zeta",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "ok"}]}]
    result = rewrite_request(body)
    assert result.moved == ["u_12345"]
    assert [t["name"] for t in result.body["tools"]] == ["alpha", "zeta"]
    assert "cache_control" in result.body["tools"][-1]
    assert "cache_control" not in result.body["tools"][0]
    last = result.body["messages"][-1]["content"]
    assert [b["type"] for b in last] == ["tool_result", "text"]
    assert "u_12345" in last[1]["text"] and "u_12345" not in result.body["system"]
    assert body["tools"][0]["name"] == "zeta"  # input untouched


def test_rewrite_without_user_turn_appends_one() -> None:
    body = {"model": "gpt-4o", "messages": [
        {"role": "system", "content": "Current time: 2026-11-29T14:03:07Z"}]}
    result = rewrite_request(body)
    assert result.body["messages"][-1]["role"] == "user"
    assert "2026-11-29T14:03:07Z" in result.body["messages"][-1]["content"]


SCREEN = "iVBORw0KGgo" + "QUJD" * 5000  # a 20 KB base64 image
OA_IMAGE = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{SCREEN}",
                                               "detail": "low"}}
AN_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": SCREEN}}
AN_DOCUMENT = {"type": "document", "source": {"type": "base64",
                                              "media_type": "application/pdf", "data": SCREEN}}


def _image_bodies() -> list[tuple[dict[str, Any], list[Any]]]:
    """(body, its media parts) for both providers: a timestamped system prompt (a value the
    rewriter moves) and images in the user turn, the Anthropic ones in a tool_result too."""
    system = BACKGROUND + "\nCurrent time: 2026-11-29T14:03:07Z\nBe brief."
    oa = openai(system, history=[{"role": "user", "content": [
        {"type": "text", "text": "What is on this screen?"}, OA_IMAGE]}])
    an = anthropic(system)
    an["messages"] = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, AN_IMAGE, AN_DOCUMENT]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [AN_IMAGE]}, {"type": "text", "text": "And?"}]}]
    return [(oa, [OA_IMAGE]), (an, [AN_IMAGE, AN_DOCUMENT, AN_IMAGE])]


def _media(body: dict[str, Any]) -> list[Any]:
    found = []
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else ():
            inner = block.get("content") if block.get("type") == "tool_result" else [block]
            found += [b for b in inner if b.get("type") in ("image_url", "image", "document")]
    return found


@pytest.mark.parametrize("index", [0, 1], ids=["openai", "anthropic"])
def test_lint_and_rewrite_leave_images_as_they_are(index: int) -> None:
    """Lint (report) and rewrite of a body with images do not fail, move the system prompt's
    timestamp, and leave every image part byte-identical; an image counts the documented
    allowance (MEDIA_TOKENS) in the layout, not the tokens of its base64 text."""
    body, media = _image_bodies()[index]
    learner = TemplateLearner()
    report = lint_request(body, learner=learner)
    assert "PL001" in [f.rule for f in report.findings]
    text_only = copy.deepcopy(body)
    for message in text_only["messages"]:
        if isinstance(message["content"], list):
            message["content"] = [b for b in message["content"] if b not in media]
            for block in message["content"]:
                if block.get("type") == "tool_result":
                    block["content"] = []
    added = report.prompt_tokens - lint_request(text_only).prompt_tokens
    assert len(media) * MEDIA_TOKENS <= added <= len(media) * (MEDIA_TOKENS + 64)
    result = rewrite_request(body, report=report, learner=learner)
    assert result.changed and "2026-11-29" not in json.dumps(result.body["system" if index
                                                                          else "messages"][0])
    assert [json.dumps(m) for m in _media(result.body)] == [json.dumps(m) for m in media]
