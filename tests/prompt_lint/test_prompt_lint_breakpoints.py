"""An Anthropic agent that moves its cache_control breakpoints every turn, as Anthropic's own
multi-turn caching pattern does: the newest block of the conversation carries the breakpoint,
earlier blocks lose theirs, and a tool-list breakpoint sits on whichever tool is last.

A breakpoint only says where to write a cache entry; Anthropic's cache matches prefixes by their
content, so a moved breakpoint changes nothing cached. The references are hand-built logs and
the request bodies themselves with every `cache_control` taken out.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from prompt_lint import TemplateLearner, lint_request
from prompt_lint.cli import fix_main, lint_main

BASE = ("You are CodeHelper, an autonomous coding agent for the Acme monorepo. Follow the "
        "repository conventions and run the tests before proposing a change. ") * 4
EPHEMERAL = {"type": "ephemeral"}
READ = {"name": "read_file", "description": "Read a file from the workspace",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}


def _tool(name: str) -> dict[str, Any]:
    return {"name": name, "description": f"The {name} tool",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}


def _drop_breakpoints(value: Any) -> Any:
    """`value` with every cache_control taken out (what Anthropic's cache matches on)."""
    if isinstance(value, dict):
        return {k: _drop_breakpoints(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_drop_breakpoints(v) for v in value]
    return value


def _breakpoints(value: Any) -> int:
    if isinstance(value, dict):
        return ("cache_control" in value) + sum(_breakpoints(v) for v in value.values())
    if isinstance(value, list):
        return sum(_breakpoints(v) for v in value)
    return 0


def agent_log(sessions: int = 2, turns: int = 3, *, clock: bool = False) -> list[dict[str, Any]]:
    """Sessions of a tool-using agent; each request's newest block carries the breakpoint and
    the blocks before it lose theirs. `clock`: the system prompt ends with the time of the
    request (a value `fix` moves out of the prefix)."""
    log = []
    for s in range(sessions):
        first = {"type": "text", "text": f"Fix the failing test in pkg{s}",
                 "cache_control": EPHEMERAL}
        messages: list[dict[str, Any]] = [{"role": "user", "content": [first]}]
        for turn in range(turns):
            system = BASE + (f"\nCurrent time: 2026-12-0{s + 1}T1{turn}:00:00Z" if clock else "")
            log.append({"model": "claude-sonnet-4-5", "max_tokens": 1024, "tools": [READ],
                        "system": [{"type": "text", "text": system, "cache_control": EPHEMERAL}],
                        "messages": copy.deepcopy(messages)})
            for message in messages:  # the breakpoint moves on to the newest block
                for block in message["content"]:
                    block.pop("cache_control", None)
            call = f"toolu_{s}{turn}"
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": call, "name": "read_file", "input": {"path": "a.py"}}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call, "content": f"line {turn}",
                 "cache_control": EPHEMERAL}]})
    return log


def _write(path: Path, bodies: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return path


def test_a_moved_breakpoint_is_no_history_edit(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the breakpoint leaving a tool_result block made that turn "differ from the
    previous request" (PL009, an error: CI failed on a cache-friendly log)."""
    log = _write(tmp_path / "log.jsonl", agent_log())
    capsys.readouterr()
    assert lint_main([str(log), "--format", "json", "--fail-on", "error"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["by_rule"].get("PL009", 0) == 0
    edited = agent_log()
    edited[2]["messages"][2]["content"][0]["content"] = "line 0, edited"
    assert lint_main([str(_write(tmp_path / "edited.jsonl", edited))]) == 1  # a real edit


def test_a_breakpoint_that_moves_with_the_last_tool_is_no_tool_change() -> None:
    """The tool order changes (PL004, which fix resolves); the breakpoint sits on the last
    tool each time. Before: each tool that gained or lost the breakpoint was "JSON changed
    (content)" (PL006), which fix cannot resolve, so the prefix after fix was estimated 0."""
    learner = TemplateLearner()

    def body(order: list[str]) -> dict[str, Any]:
        tools = [_tool(n) for n in order]
        tools[-1]["cache_control"] = EPHEMERAL
        return {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": BASE, "tools": tools,
                "messages": [{"role": "user", "content": "hello"}]}

    lint_request(body(["a", "b", "c"]), learner=learner)
    report = lint_request(body(["c", "a", "b"]), learner=learner)
    assert [f.rule for f in report.findings if f.rule in ("PL004", "PL006")] == ["PL004"]
    assert report.cacheable_tokens == 0 < report.cacheable_tokens_after_fix


def test_fix_keeps_history_when_the_client_moves_its_breakpoints(tmp_path: Path) -> None:
    """Each fixed request's earlier turns are the previous fixed request's, byte for byte but
    for the breakpoints, which stay where the client put them (so never more than the
    client's). Before: a turn whose breakpoint had moved came back without the context block
    it got as the last turn, so the conversation's cache broke there."""
    raw = agent_log(clock=True)
    fixed_path = tmp_path / "fixed.jsonl"
    assert fix_main([str(_write(tmp_path / "log.jsonl", raw)), "-o", str(fixed_path)]) == 0
    fixed = [json.loads(line) for line in fixed_path.read_text().splitlines()]
    for before, after in zip(fixed, fixed[1:], strict=False):
        if len(after["messages"]) < len(before["messages"]):
            continue  # a new session
        earlier = after["messages"][: len(before["messages"])]
        assert _drop_breakpoints(earlier) == _drop_breakpoints(before["messages"])
    for request, sent in zip(fixed, raw, strict=True):
        assert "<context>" in json.dumps(request["messages"][0])
        assert [_breakpoints(m) for m in request["messages"]] == \
            [_breakpoints(m) for m in sent["messages"]]
    assert lint_main([str(fixed_path), "--fail-on", "error"]) == 0


def test_a_breakpoint_after_a_session_value_is_reused_within_the_session() -> None:
    """A session id before the system prompt's breakpoint: across sessions no entry is
    reused, within one it is (the id stays the same). Before, PL012 said "no entry is
    reused" outright; a per-request value (a clock) still gets that."""
    learner = TemplateLearner()

    def body(session: str, clock: str) -> dict[str, Any]:
        return {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": [
            {"type": "text", "text": f"Session: {session}"},
            {"type": "text", "text": BASE + f"Current time: {clock}", "cache_control": EPHEMERAL},
            ], "messages": [{"role": "user", "content": f"hello, this is {session[-4:]}"}]}

    def pl012(report: Any) -> list[str]:
        return [f.message.split(": ", 1)[1] for f in report.findings if f.rule == "PL012"]

    reports = [lint_request(body(s, c), learner=learner)
               for s in ("sess_4f9a21c7", "sess_b80d3e12") for c in ("10:00", "10:05")]
    assert pl012(reports[-1]) == [
        "no entry is reused across sessions (within one, the value stays the same)"]
    late = lint_request({**body("sess_b80d3e12", "10:09"), "system": [
        {"type": "text", "text": "Current time: 10:09"},
        {"type": "text", "text": BASE, "cache_control": EPHEMERAL}]}, learner=TemplateLearner())
    assert all(m == "no entry is reused" for m in pl012(late))


def test_a_breakpoint_on_the_first_turn_does_not_make_it_a_session_of_its_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In its first turn the agent's only message carries the breakpoint; later turns send it
    without. The first message keys the session, so each first turn was a session of its
    own: three sessions were counted as six in the evidence, and the first turn, whose
    session goes on, was told its context block would not be reused after the fix."""
    bodies = []
    for s in range(3):
        history: list[dict[str, Any]] = []
        for t in range(3):
            history.append({"role": "user", "content": [
                {"type": "text", "text": f"Task {s}: step {t} of the refactor."}]})
            messages = copy.deepcopy(history)
            messages[-1]["content"][-1]["cache_control"] = EPHEMERAL
            bodies.append({"model": "claude-sonnet-4-5", "max_tokens": 512, "messages": messages,
                           "system": f"Current time: 2026-12-01T1{s}:0{t}:00Z\n{BASE}"})
            history.append({"role": "assistant", "content": [{"type": "text", "text": "Done."}]})
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    capsys.readouterr()
    lint_main([str(log), "--format", "json", "--fail-on", "never"])
    requests = json.loads(capsys.readouterr().out)["requests"]
    stamps = [f["message"] for r in requests for f in r["findings"] if f["rule"] == "PL001"]
    assert len(stamps) == 9 and all(m.endswith("(evidence: 9 requests in 3 sessions)")
                                    for m in stamps)
    for n, r in enumerate(requests):  # a session's next turn resends the whole request
        if n % 3 < 2:
            assert r["cacheable_tokens_after_fix"] == r["prompt_tokens"]
