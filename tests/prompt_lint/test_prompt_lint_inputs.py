"""What `prefixgate lint` / `fix` read besides plain JSONL: gzipped logs, and records of
formats it does not read, which must say so."""

from __future__ import annotations

import gzip
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from prompt_lint.cli import fix_main, lint_main

SYSTEM = "Current time: {t}. You are a travel agent for Acme. Quote prices in EUR."


def _log() -> bytes:
    bodies = [{"model": "gpt-4o", "messages": [
        {"role": "system", "content": SYSTEM.format(t=f"2026-12-01T10:{m:02d}:00Z")},
        {"role": "user", "content": f"Trip {m} to Lisbon, please."}]} for m in range(6)]
    return "".join(json.dumps(b) + "\n" for b in bodies).encode()


def _run(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_gzipped_log_reads_as_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A rotated log (`log.jsonl.gz`) was refused whole as "not UTF-8: byte 0x8b (column
    2)"; now the file, stdin and a directory's walk read it as the plain log."""
    plain = tmp_path / "log.jsonl"
    plain.write_bytes(_log())
    packed = tmp_path / "logs" / "log.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(_log()))
    want = _run(lint_main, [str(plain), "--format", "json"], capsys)
    assert want[0] == 1 and want[2] == ""
    for source in (str(packed), str(packed.parent)):
        code, out, err = _run(lint_main, [source, "--format", "json"], capsys)
        assert (code, out.replace(str(packed), str(plain)), err) == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(packed.read_bytes())))
    code, out, err = _run(lint_main, ["-", "--format", "json"], capsys)
    assert (code, out.replace("<stdin>", str(plain)), err) == want


def test_fix_writes_gzip_to_a_gz_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    packed = tmp_path / "log.jsonl.gz"
    packed.write_bytes(gzip.compress(_log()))
    assert _run(fix_main, [str(packed), "-o", str(tmp_path / "plain.jsonl")], capsys)[0] == 0
    assert _run(fix_main, [str(packed), "-o", str(tmp_path / "fixed.jsonl.gz")], capsys)[0] == 0
    fixed = gzip.decompress((tmp_path / "fixed.jsonl.gz").read_bytes())
    assert fixed == (tmp_path / "plain.jsonl").read_bytes()
    assert b"[context:timestamp_1]" in fixed


def test_a_cut_gzip_stream_is_one_line_and_exit_two(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cut = tmp_path / "log.jsonl.gz"
    cut.write_bytes(gzip.compress(_log())[:60])
    code, out, err = _run(lint_main, [str(cut)], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"prefixgate lint: {cut}: cannot read: not a whole gzip stream (")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(("record", "keys"), [
    ({"model": "gpt-4o", "instructions": "Be brief.", "input": "hi"},  # Responses API
     "model, instructions, input"),
    ({"name": "chat gpt-4o", "attributes": {"gen_ai.prompt.0.content": "hi"}},  # an OTel span
     "name, attributes"),
    ({"id": "r1", "run_type": "llm", "inputs": {"messages": [[]]}, "outputs": {}},  # LangSmith
     "id, run_type, inputs, outputs"),
], ids=["responses-api", "otel-span", "langsmith-run"])
def test_a_record_of_another_format_says_what_is_read(
        record: dict[str, Any], keys: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It was "'messages' must be a non-empty list", which reads as a broken request, not
    as a log format prefixgate does not read."""
    path = tmp_path / "export.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert _run(lint_main, [str(path)], capsys)[1:] == ("", (
        f"prefixgate lint: {path}:1: no 'messages': not an OpenAI Chat Completions or "
        "Anthropic Messages request body, nor an envelope holding one under 'request' or "
        f"'body' (its keys: {keys})\n"))


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"],
                         ids=["line-separator", "paragraph-separator", "next-line"])
def test_a_line_separator_inside_a_string_does_not_end_the_line(
        char: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON strings may hold these raw (`json.dumps(..., ensure_ascii=False)`, the way `fix`
    itself writes): the log was refused as "Unterminated string", and so was a fixed log of
    one that held them escaped. Read raw, the log lints as the escaped one does, and its fix
    reads back."""
    bodies = [json.loads(line) for line in _log().decode().splitlines()]
    for b in bodies:
        b["messages"][1]["content"] += f"{char}Window seat, please."
    escaped, raw = tmp_path / "escaped.jsonl", tmp_path / "raw.jsonl"
    escaped.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    raw.write_text("".join(json.dumps(b, ensure_ascii=False) + "\n" for b in bodies),
                   encoding="utf-8")
    assert char in raw.read_text(encoding="utf-8")
    want = _run(lint_main, [str(escaped), "--format", "json"], capsys)
    got = _run(lint_main, [str(raw), "--format", "json"], capsys)
    assert want[0] == 1 and got == (want[0], want[1].replace(str(escaped), str(raw)), "")
    fixed = tmp_path / "fixed.jsonl"
    assert _run(fix_main, [str(escaped), "-o", str(fixed)], capsys)[0] == 0
    assert char in fixed.read_text(encoding="utf-8")
    code, out, err = _run(lint_main, [str(fixed), "--format", "json"], capsys)
    assert (code, err) == (0, "") and json.loads(out)["summary"]["requests"] == len(bodies)
