"""`prefixgate lint --skip-invalid`: a log with bad records is linted as the same log without
them would be, and each record left out is named (stderr, the JSON report, SARIF)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prompt_lint.cli import SKIPPED_SHOWN, fix_main, lint_main

from .test_prompt_lint_cli import _sessions_log, run

SYSTEM = ("[uid={uid}] You are TravelBot, a helpful travel agent for Acme Corp. Always be "
          "concise and cite prices in EUR.")
#: The problem named for a `{"object": ...}` record (a response, not a request).
NOT_A_REQUEST = ("no 'messages': not an OpenAI Chat Completions or Anthropic Messages request "
                 "body, nor an envelope holding one under 'request' or 'body' (its keys: object)")
#: What an agent's log holds besides requests, each with the problem the lint names.
BAD = [
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "cont', "invalid JSON"),  # cut short
    (b'{"id": "chatcmpl-1", "object": "chat.completion", "choices": []}',
     "no 'messages': not an OpenAI Chat Completions"),  # a response record
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "caf\xe9"}]}',
     "not UTF-8: byte 0xe9 (column 66)"),  # Latin-1
    (b'{"model": "gpt-4o", "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}',
     "NaN is not a JSON number"),
]


def _good_and_bad(tmp_path: Path) -> tuple[Path, Path, list[int]]:
    """A clean log of four sessions' requests, and the same requests with a bad record
    after every third one; the line of each good request in the second."""
    clean = tmp_path / "clean.jsonl"
    _sessions_log(clean, SYSTEM, ["user_44cb63", "user_204f89", "user_829868", "user_3c5fd7"])
    good = clean.read_bytes().splitlines(keepends=True)
    lines: list[bytes] = []
    at: list[int] = []
    for n, line in enumerate(good):
        lines.append(line)
        at.append(len(lines))
        if n % 3 == 2:
            lines.append(BAD[(n // 3) % len(BAD)][0] + b"\n")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"".join(lines))
    return clean, mixed, at


def _findings(doc: dict[str, Any]) -> list[tuple[str | None, list[Any]]]:
    return [(r["family"], [(f["rule"], f["path"], f["start"], f["value"]) for f in r["findings"]])
            for r in doc["requests"]]


def test_bad_records_are_left_out_and_the_rest_linted_as_without_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean, mixed, at = _good_and_bad(tmp_path)
    code, out, _ = run(lint_main, [str(mixed), "--format", "json"], capsys)
    assert code == 2 and out == ""  # strict by default: the whole input is refused

    code, want, _ = run(lint_main, [str(clean), "--format", "json", "--show-values"], capsys)
    assert code == 1
    code, got, err = run(lint_main, [str(mixed), "--format", "json", "--show-values",
                                     "--skip-invalid"], capsys)
    expected, doc = json.loads(want), json.loads(got)
    assert code == 1  # by its findings, as for the clean log
    assert _findings(doc) == _findings(expected) and _findings(doc)[0][1]  # PL013 each
    assert [r["line"] for r in doc["requests"]] == at
    assert doc["summary"] == expected["summary"] and "skipped" not in expected
    bad_lines = [n for n in range(1, len(at) + 5) if n not in at]
    assert [s["line"] for s in doc["skipped"]] == bad_lines
    for entry, (_, problem) in zip(doc["skipped"], BAD, strict=True):
        assert entry["source"] == str(mixed)
        assert entry["problem"] == f"{mixed}:{entry['line']}: " + \
            entry["problem"].split(": ", 1)[1] and problem in entry["problem"]
    assert err.splitlines() == [f"prefixgate lint: {s['problem']} (skipped)"
                                for s in doc["skipped"]]


def test_skipped_records_are_sarif_notifications_at_their_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, mixed, at = _good_and_bad(tmp_path)
    code, out, _ = run(lint_main, [str(mixed), "--format", "sarif", "--skip-invalid"], capsys)
    run_ = json.loads(out)["runs"][0]
    notes = run_["invocations"][0]["toolExecutionNotifications"]
    assert code == 1 and len(run_["results"]) == len(at)
    assert [n["locations"][0]["physicalLocation"]["region"]["startLine"] for n in notes] == \
        [n for n in range(1, len(at) + 5) if n not in at]
    assert all(n["level"] == "error" and str(mixed) in n["message"]["text"] for n in notes)


def test_a_json_array_keeps_its_good_records_at_their_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    path = tmp_path / "log.json"
    path.write_text(json.dumps([request, {"object": "chat.completion"}, request], indent=2))
    lines = path.read_text().splitlines()
    starts = [n for n, line in enumerate(lines, start=1) if line == "  {"]
    code, out, err = run(lint_main, [str(path), "--format", "json", "--skip-invalid",
                                     "--fail-on", "never"], capsys)
    doc = json.loads(out)
    assert code == 0 and [r["line"] for r in doc["requests"]] == [starts[0], starts[2]]
    assert [s["line"] for s in doc["skipped"]] == [starts[1]]
    assert err == f"prefixgate lint: {path}:{starts[1]}: {NOT_A_REQUEST} (skipped)\n"


def test_nothing_left_is_bad_input_after_naming_each_record(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    count = SKIPPED_SHOWN + 5
    path.write_text('{"object": "chat.completion"}\n' * count)
    code, out, err = run(lint_main, [str(path), "--skip-invalid"], capsys)
    lines = err.splitlines()
    assert code == 2 and out == ""
    assert lines[:SKIPPED_SHOWN] == [f"prefixgate lint: {path}:{n}: {NOT_A_REQUEST} (skipped)"
                                     for n in range(1, SKIPPED_SHOWN + 1)]
    assert lines[SKIPPED_SHOWN:] == [
        f"prefixgate lint: ... and 5 more records skipped ({count} in all)",
        f"prefixgate lint: no requests found in {path}"]


def test_fix_has_no_lenient_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fixed log must hold every record of its input: fix refuses bad input whole."""
    _, mixed, _ = _good_and_bad(tmp_path)
    out = tmp_path / "fixed.jsonl"
    with pytest.raises(SystemExit) as exc:
        fix_main([str(mixed), "-o", str(out), "--skip-invalid"])
    assert exc.value.code == 2 and not out.exists()
    assert "unrecognized arguments: --skip-invalid" in capsys.readouterr().err
