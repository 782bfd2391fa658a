"""Several agents in one log: each agent's fixed system prompt is stable, however alike they are.

A coder and a reviewer (as a multi-agent framework runs them) share a long preamble on one line
and differ in their first words and in their tools; their sessions interleave in the log. Each
agent sends the very same system prompt in every session, so nothing in it is dynamic (written
out here by hand: the log holds no value that changes), and fix must leave it in place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prompt_lint.cli import fix_main, lint_main

PREAMBLE = " ".join(f"Rule {i}: run the tests of module {i} before committing and never push "
                    "to main." for i in range(60))
AGENTS = {
    "coder": ("You are a coding agent working in a monorepo. ", ["bash", "read_file", "write"]),
    "reviewer": ("You are a code reviewer. ", ["read_file"]),
}


def _tool(name: str) -> dict[str, Any]:
    return {"name": name, "description": f"The {name} tool.",
            "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}}}


def _log(sessions: int = 5, turns: int = 3) -> list[dict[str, Any]]:
    out = []
    for s in range(sessions):
        history: dict[str, list[dict[str, Any]]] = {name: [] for name in AGENTS}
        for t in range(turns):
            for name, (role, tools) in AGENTS.items():
                history[name].append({"role": "user", "content": f"Task {s}.{t} for the {name}."})
                out.append({"model": "claude-sonnet-4-5", "max_tokens": 1024,
                            "system": [{"type": "text", "text": role + PREAMBLE,
                                        "cache_control": {"type": "ephemeral"}}],
                            "tools": [_tool(n) for n in tools],
                            "messages": list(history[name])})
                history[name].append({"role": "assistant", "content": "Done."})
    return out


def test_each_agents_own_system_prompt_is_not_a_dynamic_value(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both agents were one prompt family, and each agent's first words, the same in all its
    sessions, were a PL013 session-scoped error (fix moved "coding agent working in a
    monorepo" out of the coder's system prompt into its user turn)."""
    log = tmp_path / "agents.jsonl"
    bodies = _log()
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    capsys.readouterr()
    assert lint_main([str(log), "--format", "json", "--fail-on", "never"]) == 0
    report = json.loads(capsys.readouterr().out)
    dynamic = [(r["index"], f["rule"]) for r in report["requests"] for f in r["findings"]
               if f["start"] is not None]
    assert dynamic == []
    assert len({r["family"] for r in report["requests"]}) == 2
    assert fix_main([str(log), "-o", str(tmp_path / "fixed.jsonl")]) == 0
    fixed = [json.loads(line) for line in (tmp_path / "fixed.jsonl").read_text().splitlines()]
    assert [b["system"] for b in fixed] == [b["system"] for b in bodies]


def _function(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                             "parameters": {"type": "object"}}}


def test_an_agent_that_adds_a_tool_to_one_request_keeps_its_family(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One request of one session sends a fourth tool. Were it a family of its own, it
    would have no evidence, and its tenant id, the same UUID in every request of the log,
    would be a pattern-only PL002 error that fix moves out. The timestamp, which changes
    every request, is the only dynamic value (written out by hand)."""
    guide = "\n".join(f"Rule {i}: keep answers about area {i} short." for i in range(30))
    tenant = "3f1c2a9e-7b4d-4e21-9a0c-5d8e2f6b1a47"
    bodies = []
    for s in range(5):
        for t in range(3):
            names = ["lookup", "refund", "notify"] + (["escalate"] if (s, t) == (2, 2) else [])
            system = f"Current time: 2026-12-01T1{s}:{10 + t}:00Z\nTenant id: {tenant}\n{guide}"
            bodies.append({"model": "gpt-4o", "tools": [_function(n) for n in names],
                           "messages": [{"role": "system", "content": system},
                                        {"role": "user", "content": f"Case {s}, question {t}."}]})
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    capsys.readouterr()
    lint_main([str(log), "--format", "json", "--show-values", "--fail-on", "never"])
    report = json.loads(capsys.readouterr().out)
    values = [[(f["rule"], f["value"]) for f in r["findings"] if f["start"] is not None]
              for r in report["requests"]]
    stamps = [b["messages"][0]["content"][14:34] for b in bodies]
    assert values == [[("PL001", stamp)] for stamp in stamps]
