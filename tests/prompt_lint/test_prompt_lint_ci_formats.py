"""Reports a CI system reads: SARIF locations that are URIs."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from prompt_lint.cli import lint_main

#: RFC 3986: the characters a URI reference may hold (anything else is percent-encoded).
URI_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
BODY = {"model": "gpt-4o", "messages": [
    {"role": "system", "content": "Current time: 2026-12-01T10:00:00Z. You are a travel agent."},
    {"role": "user", "content": "A trip to Lisbon."}]}


def _uris(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert lint_main([*argv, "--format", "sarif"]) == 1
    run = json.loads(capsys.readouterr().out)["runs"][0]
    return [loc["physicalLocation"]["artifactLocation"]["uri"]
            for result in run["results"] for loc in result["locations"]]


def _decoded(uri: str) -> str:
    """The file a URI reference names, decoded by the standard library."""
    parts = urlsplit(uri)
    assert parts.fragment == "" and parts.query == ""
    assert parts.scheme in {"", "file"} and parts.netloc == ""
    return unquote(parts.path)


def test_sarif_locations_are_uri_references(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A log in `agent logs #1/` was located at the raw path: a space is no URI character
    and `#` starts a fragment, so code scanning refused the file or cut its name; stdin was
    `<stdin>`; an absolute path was a bare `/tmp/...`, no `file://` URI."""
    folder = tmp_path / "agent logs #1"
    folder.mkdir()
    log = folder / "run 100%.jsonl"
    log.write_text(json.dumps(BODY) + "\n")
    monkeypatch.chdir(tmp_path)
    cases: list[tuple[list[str], str, Any]] = [
        ([str(log)], str(log), "file"), (["agent logs #1/run 100%.jsonl"],
                                         "agent logs #1/run 100%.jsonl", "")]
    for argv, source, scheme in cases:
        uris = _uris(argv, capsys)
        assert uris and all(URI_CHARS.fullmatch(u) for u in uris), uris
        assert {urlsplit(u).scheme for u in uris} == {scheme}
        assert {_decoded(u) for u in uris} == {source}
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(log.read_bytes())))
    uris = _uris(["-"], capsys)
    assert all(URI_CHARS.fullmatch(u) for u in uris) and {_decoded(u) for u in uris} == \
        {"<stdin>"}


#: A workflow command as GitHub Actions parses it: `::level key=value,key=value::message`.
COMMAND = re.compile(r"::(error|warning|notice) ([^:]*)::(.*)")


def _unescape(text: str) -> str:
    for code, char in (("%0D", "\r"), ("%0A", "\n"), ("%3A", ":"), ("%2C", ","), ("%25", "%")):
        text = text.replace(code, char)
    return text


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"{name}, 100% safe.",
                                             "parameters": {"type": "object"}}}


def test_github_annotations_carry_every_finding(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`--format github`: one annotation per finding, at the record's file and line, that
    GitHub's parser reads back whole (a file name with `,` and `:`; messages with both)."""
    log = tmp_path / "run,1:agent.jsonl"
    bodies = []
    for m in range(6):
        tools = [_tool("search"), _tool("book")][:: 1 if m != 3 else -1]  # reordered once
        system = f"Current time: 2026-12-01T10:0{m}:00Z.\nYou are a travel agent."
        bodies.append({"model": "gpt-4o", "tools": tools, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": f"Trip {m}."}]})
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    assert lint_main([str(log), "--format", "json", "--show-values"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert lint_main([str(log), "--format", "github", "--show-values"]) == 1
    lines = capsys.readouterr().out.splitlines()
    commands = [COMMAND.fullmatch(line) for line in lines if line.startswith("::")]
    assert all(commands) and len(commands) == doc["summary"]["findings"]
    levels = {"error": "error", "warning": "warning", "info": "notice"}
    want = [(levels[f["severity"]], str(log), str(r["line"]), f"{f['rule']} {f['name']}",
             f["message"], f["value"]) for r in doc["requests"] for f in r["findings"]]
    got = []
    for match, (*_, message, value) in zip(commands, want, strict=True):
        assert match is not None
        props = dict(p.split("=", 1) for p in match.group(2).split(","))
        text = _unescape(match.group(3))
        assert text.endswith(message + (f" [{value}]" if value else ""))
        got.append((match.group(1), _unescape(props["file"]), props["line"],
                    _unescape(props["title"]), message, value))
    assert got == want
    assert {"PL001", "PL004"} <= set(doc["summary"]["by_rule"])
    assert lines[-3].startswith(f"summary: 6 requests, {len(want)} findings")
