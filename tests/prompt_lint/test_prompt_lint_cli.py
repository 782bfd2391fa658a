"""`prefixgate lint` / `prefixgate fix` through prompt_lint.cli, and one real subprocess."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from prompt_lint import cli
from prompt_lint.cli import fix_main, lint_main

from .lint_linted import Linted

ROOT = Path(__file__).resolve().parents[2]
CLEAN = {"model": "gpt-4o", "messages": [{"role": "system", "content": "You help."},
                                         {"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory, two_pass: Linted) -> Path:
    path = tmp_path_factory.mktemp("lint") / "log.jsonl"
    path.write_text("".join(json.dumps(r.body) + "\n" for r in two_pass.corpus))
    return path


def _count(log: Path) -> int:
    return len(log.read_text().splitlines())


def run(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_schema_matches_library(log: Path, two_pass: Linted,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(lint_main, [str(log), "--format", "json", "--show-values"], capsys)
    doc = json.loads(out)
    assert code == 1
    assert [r["index"] for r in doc["requests"]] == list(range(len(two_pass.corpus)))
    for entry, req in zip(doc["requests"], two_pass.corpus, strict=True):
        assert {"index", "findings", "prompt_tokens", "cacheable_tokens",
                "cacheable_tokens_after_fix"} <= set(entry)
        for f in entry["findings"]:
            assert {"rule", "name", "severity", "path", "start", "end", "kind"} <= set(f)
            assert (f["start"] is None) == (f["end"] is None)
        labelled = {(lb.path, lb.value) for lb in req.labels}
        flagged = {(f["path"], f["value"]) for f in entry["findings"] if f["start"] is not None}
        assert {v.rstrip(".") for _, v in labelled} <= {v.rstrip(".") for _, v in flagged}
    summary = doc["summary"]
    assert summary["requests"] == len(two_pass.corpus)
    assert summary["findings"] == sum(len(r["findings"]) for r in doc["requests"])
    assert summary["hit_rate_after_fix"] > summary["hit_rate_now"]


def test_values_are_masked_unless_asked(log: Path, two_pass: Linted,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    secrets = {lb.value for r in two_pass.corpus for lb in r.labels
               if lb.kind != "learned" and len(lb.value) >= 6}
    assert len(secrets) > 50
    for fmt in ("text", "json", "sarif"):
        _, out, _ = run(lint_main, [str(log), "--format", fmt], capsys)
        assert not [s for s in secrets if s in out], fmt
    _, out, _ = run(lint_main, [str(log), "--show-values"], capsys)
    assert all(s in out for s in secrets)
    assert f"summary: {len(two_pass.corpus)} requests" in out and "expected hit-rate change" in out


def test_sarif(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(lint_main, [str(log), "--format", "sarif"], capsys)
    _, js, _ = run(lint_main, [str(log), "--format", "json"], capsys)
    sarif, doc = json.loads(out), json.loads(js)
    assert sarif["version"] == "2.1.0"
    run_ = sarif["runs"][0]
    assert {r["id"] for r in run_["tool"]["driver"]["rules"]} >= {"PL001", "PL012"}
    assert len(run_["results"]) == doc["summary"]["findings"]
    first = run_["results"][0]["locations"][0]
    assert first["physicalLocation"]["region"]["startLine"] == 1


@pytest.mark.parametrize(("fail_on", "expected"), [("error", 0), ("warning", 0), ("info", 1),
                                                   ("never", 0)])
def test_exit_codes(tmp_path: Path, fail_on: str, expected: int,
                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "one.json"
    body = dict(CLEAN, tools=[{"type": "function", "function": {"name": "b"}},
                              {"type": "function", "function": {"name": "a"}}])
    path.write_text(json.dumps(body, indent=2))  # a single pretty JSON file
    code, _, _ = run(lint_main, [str(path), "--fail-on", fail_on], capsys)
    assert code == expected  # only an info finding (tools not sorted)


def test_clean_log_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps(CLEAN) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text(json.dumps([CLEAN, CLEAN]))
    code, out, _ = run(lint_main, [str(tmp_path), "--format", "json", "--fail-on", "info"],
                       capsys)
    doc = json.loads(out)
    assert code == 0 and len(doc["requests"]) == 3
    assert [r["source"].endswith(("a.jsonl", "b.json")) for r in doc["requests"]] == [True] * 3


def _nested(levels: int) -> str:
    """A request line whose `metadata` is `levels` arrays deep."""
    return ('{"model": "x", "messages": [{"role": "user", "content": "hi"}], "metadata": '
            + "[" * levels + "]" * levels + "}")


def _number(text: str) -> str:
    """A request line whose `temperature` is spelled `text`."""
    return ('{"model": "x", "temperature": ' + text
            + ', "messages": [{"role": "user", "content": "hi"}]}')


SURROGATE = ('{"model": "x", "messages": [{"role": "system", "content": "You are helpful '
             '\\ud800"}, {"role": "user", "content": "hi"}]}')


@pytest.mark.parametrize(("line", "problem"), [
    ('{"model": "x", "messages": [', "invalid JSON"),
    ('{"model": "x"}', "no 'messages': not an OpenAI Chat Completions or Anthropic Messages"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "role 'wizard'"),
    # a RecursionError traceback and exit 1 (read by CI as a finding) before
    (_nested(1100), "JSON nested deeper than 128 levels"),
    (_nested(200), "JSON nested deeper than 128 levels"),  # parses, but past the bound
    # a UnicodeEncodeError traceback from the family id's hash before
    (SURROGATE, "lone UTF-16 surrogate escape in a string, 'You are helpful \\ud800'"),
    # not JSON numbers (RFC 8259; orjson refuses them): linted before, and `fix` wrote
    # `NaN` / `Infinity` (1e400 too) back, a log no JSON parser or provider reads
    (_number("NaN"), "invalid JSON: NaN is not a JSON number"),
    (_number("-Infinity"), "invalid JSON: -Infinity is not a JSON number"),
    (_number("1e400"), "invalid JSON: number 1e400 is out of range"),
    # a message without file and line that named a Python setting before
    (_number("9" * 5000), "invalid JSON: integer of 5000 digits is out of range"),
], ids=["invalid-json", "no-messages", "bad-role", "nested-1100", "nested-200", "surrogate",
        "nan", "infinity", "1e400", "long-int"])
@pytest.mark.parametrize("fmt", ["text", "json", "sarif"])
def test_bad_input_exits_two_without_partial_report(tmp_path: Path, line: str, problem: str,
                                                    fmt: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CLEAN) + "\n\n" + line + "\n" + json.dumps(CLEAN) + "\n")
    code, out, err = run(lint_main, [str(path), "--format", fmt], capsys)
    assert code == 2 and out == ""
    assert err == f"prefixgate lint: {path}:3: " + err.split(f"{path}:3: ", 1)[1]
    assert problem in err and len(err.splitlines()) == 1
    code, _, err = run(fix_main, [str(path), "-o", str(tmp_path / "out.jsonl")], capsys)
    assert code == 2 and not (tmp_path / "out.jsonl").exists()
    assert err.startswith(f"prefixgate fix: {path}:3: ") and problem in err


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400", "9" * 5000, "0.5", "7"])
def test_numbers_are_refused_as_a_strict_json_parser_refuses_them(
        tmp_path: Path, number: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The reference is orjson (the gateway's parser): what it refuses is bad input (exit 2),
    what it reads is linted, and `fix` writes it back as orjson reads it."""
    line = _number(number)
    try:
        expected = orjson.loads(line)
    except orjson.JSONDecodeError:
        expected = None
    path = tmp_path / "n.jsonl"
    path.write_text(line + "\n")
    code, _, _ = run(lint_main, [str(path)], capsys)
    assert code == (2 if expected is None else 0)
    if expected is not None:
        out = tmp_path / "out.jsonl"
        assert run(fix_main, [str(path), "-o", str(out)], capsys)[0] == 0
        assert orjson.loads(out.read_text()) == expected


def test_a_deep_first_line_is_refused_at_its_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The first line is parsed once as a whole document first (a JSON file): its
    RecursionError escaped from there too."""
    path = tmp_path / "deep.jsonl"
    path.write_text("\n" + _nested(1100) + "\n" + json.dumps(CLEAN) + "\n")
    code, out, err = run(lint_main, [str(path)], capsys)
    assert (code, out) == (2, "") and f"{path}:2: JSON nested deeper than 128 levels" in err
    path.write_text(json.dumps(json.loads(_nested(129)), indent=1))  # one pretty JSON file
    code, _, err = run(lint_main, [str(path)], capsys)
    assert code == 2 and f"{path}:1: JSON nested deeper than 128 levels" in err
    path.write_text(_nested(127) + "\n")  # within the bound: linted
    assert run(lint_main, [str(path)], capsys)[0] == 0


def test_a_line_that_is_not_utf8_is_refused_at_its_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As for a line that is not JSON: exit 2, `file:line: problem`. Before, the message had
    no line (`file: cannot read: 'utf-8' codec can't decode…`), and from stdin it was a
    UnicodeDecodeError traceback."""
    raw = (json.dumps(CLEAN) + "\n\n").encode() + \
        b'{"model": "x", "messages": [{"role": "user", "content": "h\xff"}]}\n'
    path = tmp_path / "latin.jsonl"
    path.write_bytes(raw)
    problem = ":3: not UTF-8: byte 0xff (column 59)"
    code, out, err = run(lint_main, [str(path)], capsys)
    assert (code, out, err) == (2, "", f"prefixgate lint: {path}{problem}\n")
    code, _, err = run(fix_main, [str(path), "-o", str(tmp_path / "out.jsonl")], capsys)
    assert (code, err) == (2, f"prefixgate fix: {path}{problem}\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))
    code, out, err = run(lint_main, ["-"], capsys)
    assert (code, out, err) == (2, "", f"prefixgate lint: <stdin>{problem}\n")


@pytest.mark.parametrize("where", ["missing-dir", "directory", "denied"])
@pytest.mark.parametrize("main", [lint_main, fix_main], ids=["lint", "fix"])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_two(
        tmp_path: Path, where: str, main: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """-o in a directory that does not exist, -o naming a directory, -o where writing is
    refused: one `path: cannot write: reason` line, exit 2 (an OSError traceback and exit 1,
    a finding to CI, before)."""
    src = tmp_path / "log.jsonl"
    src.write_text(json.dumps(CLEAN) + "\n")
    out_path = {"missing-dir": tmp_path / "no" / "such" / "x.jsonl", "directory": tmp_path,
                "denied": tmp_path / "x.jsonl"}[where]
    reason = {"missing-dir": "No such directory", "directory": "Is a directory",
              "denied": "Permission denied"}[where]
    if where == "denied":  # the tests may run as root, which no file mode stops
        def refuse(self: Path, *args: Any, **kwargs: Any) -> int:
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "write_text", refuse)
        monkeypatch.setattr(Path, "write_bytes", refuse)
        opener = Path.open

        def refuse_writing(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if "r" in mode:  # the log is still read (twice)
                return opener(self, mode, *args, **kwargs)
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "open", refuse_writing)
    code, out, err = run(main, [str(src), "-o", str(out_path)], capsys)
    prog = "prefixgate lint" if main is lint_main else "prefixgate fix"
    assert (code, out, err) == (2, "", f"{prog}: {out_path}: cannot write: {reason}\n")


def test_cli_errors_are_never_a_traceback(tmp_path: Path) -> None:
    """The real command on QA's inputs: exit 2 and one line, never exit 1 with a traceback."""
    cases = {"d2.jsonl": _nested(1100).encode(), "s2.jsonl": SURROGATE.encode(),
             "nonutf8.jsonl": b'{"model":"x","messages":[{"role":"user","content":"h\xff"}]}'}
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw + b"\n")
        for argv in (["lint", str(tmp_path / name)],
                     ["fix", str(tmp_path / name), "-o", str(tmp_path / "out.jsonl")]):
            proc = subprocess.run([sys.executable, "-m", "gateway.cli", *argv],
                                  capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert proc.returncode == 2 and proc.stdout == "", (argv, proc.stderr)
            assert len(proc.stderr.splitlines()) == 1 and f"{name}:1: " in proc.stderr


def test_unknown_encoding_is_bad_input(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(lint_main, [str(log), "--encoding", "nope"], capsys)
    assert code == 2 and out == "" and "unknown encoding" in err


def test_fix_then_lint_is_clean(log: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    fixed = tmp_path / "fixed.jsonl"
    code, _, err = run(fix_main, [str(log), "-o", str(fixed)], capsys)
    assert code == 0 and f"{_count(log)} requests" in err
    lines = fixed.read_text().splitlines()
    assert len(lines) == _count(log)
    again = tmp_path / "again.jsonl"
    run(fix_main, [str(log), "-o", str(again)], capsys)
    assert again.read_text() == fixed.read_text()  # deterministic bytes
    _, out, _ = run(lint_main, [str(fixed), "--format", "json"], capsys)
    dynamic = [f for r in json.loads(out)["requests"] for f in r["findings"]
               if f["rule"] in {"PL001", "PL002", "PL003", "PL004", "PL008"}]
    assert dynamic == []


def test_prefixgate_lint_subprocess(log: Path) -> None:
    exe = ROOT / ".venv" / "bin" / "prefixgate"
    if not exe.exists():
        pytest.skip("prefixgate is not installed in .venv")
    proc = subprocess.run([str(exe), "lint", str(log), "--format", "json"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert len(json.loads(proc.stdout)["requests"]) == _count(log)
    probe = subprocess.run([sys.executable, "-c", "import sys, prompt_lint.cli; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert probe.stdout.strip() == "False"


def _sessions_log(path: Path, system: str, users: list[str]) -> list[str]:
    """Write one session per user id, three turns each, system prompt `system` with the id
    in place of {uid}; returns each line's user id."""
    lines, ids = [], []
    for s, uid in enumerate(users):
        for t in range(3):
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": system.format(uid=uid)},
                {"role": "user", "content": f"Question 0 for session {s}: find flights"}]
            for k in range(t):
                messages += [{"role": "assistant", "content": "ok"},
                             {"role": "user", "content": f"Question {k + 1} for session {s}"}]
            lines.append(json.dumps({"model": "gpt-4o", "messages": messages}) + "\n")
            ids.append(uid)
    path.write_text("".join(lines))
    return ids


@pytest.mark.parametrize("system", [
    "[uid={uid}] You are TravelBot, a helpful travel agent for Acme Corp. Always be concise "
    "and cite prices in EUR.",
    "User: {uid}. You are TravelBot, a helpful travel agent for Acme Corp. Always be concise "
    "and cite prices in EUR.",
])
def test_lint_finds_a_user_id_at_the_front_of_a_one_line_prompt(
        tmp_path: Path, system: str, capsys: pytest.CaptureFixture[str]) -> None:
    """QA's uid2 log: four sessions whose one-line system prompts differ only by the user id
    at the front. Before: 0 findings, four families, "cacheable prefix: 100.0%"."""
    path = tmp_path / "uid.jsonl"
    ids = _sessions_log(path, system, ["user_44cb63", "user_204f89", "user_829868",
                                       "user_3c5fd7"])
    code, out, _ = run(lint_main, [str(path), "--format", "json", "--show-values"], capsys)
    doc = json.loads(out)
    assert code == 1
    assert len({r["family"] for r in doc["requests"]}) == 1
    for n, (entry, uid) in enumerate(zip(doc["requests"], ids, strict=True)):
        assert [(f["rule"], f["value"]) for f in entry["findings"]] == [("PL013", uid)]
        if n % 3 == 2:  # a session's last turn: the next request, another session's, breaks at
            assert entry["cacheable_tokens"] < entry["prompt_tokens"] // 4  # the id
        else:  # the session's next turn sends the same id
            assert entry["cacheable_tokens"] == entry["prompt_tokens"]
    code, out, _ = run(lint_main, [str(path)], capsys)
    assert code == 1 and "by rule: PL013 12" in out and "cacheable prefix: 100.0%" not in out


def test_fix_writes_envelopes_back_with_only_the_body_rewritten(
        log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log of `{"request": body, "response": ...}` records (or `body`): `fix` wrote the
    bare rewritten bodies before, dropping each record's response and metadata. The
    reference for the bodies is `fix` of the same bodies without their envelopes."""
    bodies = [json.loads(line) for line in log.read_text().splitlines()]
    records = [{"ts": f"2026-11-29T10:{i % 60:02d}:00Z", "request": b,
                "response": {"id": f"r{i}", "usage": {"prompt_tokens": i}}} if i % 2 else
               {"body": b, "status": 200} for i, b in enumerate(bodies)]
    wrapped = tmp_path / "wrapped.jsonl"
    wrapped.write_text("".join(json.dumps(r) + "\n" for r in records))
    bare, out = tmp_path / "bare.jsonl", tmp_path / "out.jsonl"
    assert run(fix_main, [str(log), "-o", str(bare)], capsys)[0] == 0
    assert run(fix_main, [str(wrapped), "-o", str(out)], capsys)[0] == 0
    expected = [json.loads(line) for line in bare.read_text().splitlines()]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == len(records)
    for record, fixed, body in zip(records, got, expected, strict=True):
        key = "request" if "request" in record else "body"
        assert list(fixed) == list(record)  # same fields, same order
        assert {k: v for k, v in fixed.items() if k != key} == \
            {k: v for k, v in record.items() if k != key}
        assert fixed[key] == body
    again = tmp_path / "again.jsonl"
    assert run(fix_main, [str(out), "-o", str(again)], capsys)[0] == 0
    assert again.read_text() == out.read_text()  # idempotent through the envelopes


def test_fix_to_a_json_file_writes_one_json_document(
        log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`-o fixed.json` for a log of many requests wrote JSONL into the .json file, which
    json.load refuses ("Extra data"); now the array of what the JSONL output holds."""
    jsonl, one = tmp_path / "fixed.jsonl", tmp_path / "fixed.json"
    assert run(fix_main, [str(log), "-o", str(jsonl)], capsys)[0] == 0
    assert run(fix_main, [str(log), "-o", str(one)], capsys)[0] == 0
    expected = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(expected) > 1 and json.loads(one.read_text()) == expected
    single = tmp_path / "single.jsonl"
    single.write_text(log.read_text().splitlines()[0] + "\n")
    assert run(fix_main, [str(single), "-o", str(one)], capsys)[0] == 0
    assert isinstance(json.loads(one.read_text()), dict)  # one request: the object itself


@pytest.mark.parametrize("value", ["0", "-3", "many"])
@pytest.mark.parametrize("main", [lint_main, fix_main], ids=["lint", "fix"])
def test_a_bad_max_families_is_a_usage_error(log: Path, tmp_path: Path, value: str, main: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-families 0` was a ValueError traceback from the learner and exit 1 (a finding,
    to CI); now argparse's usage error naming the flag, exit 2, as for any bad flag value."""
    with pytest.raises(SystemExit) as exited:
        main([str(log), "-o", str(tmp_path / "out.jsonl"), "--max-families", value])
    _, err = capsys.readouterr()
    assert exited.value.code == 2
    assert "--max-families" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("name", ["bom.jsonl", "bom.json"])
def test_a_utf8_byte_order_mark_is_not_bad_input(
        log: Path, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A log saved with a UTF-8 byte order mark (Windows editors, PowerShell's Out-File) was
    refused whole: 'invalid JSON: Unexpected UTF-8 BOM', exit 2. The reference is the report
    of the same log without the mark, from a file, from stdin and from `fix`."""
    lines = log.read_text().splitlines()[:24]
    text = "\n".join(lines) + "\n" if name.endswith("jsonl") else \
        json.dumps([json.loads(line) for line in lines], indent=2)
    plain, marked = tmp_path / ("plain" + name[3:]), tmp_path / name
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    expected = run(lint_main, [str(plain), "--format", "json"], capsys)
    code, out, err = run(lint_main, [str(marked), "--format", "json"], capsys)
    assert (code, json.loads(out)["summary"], err) == \
        (expected[0], json.loads(expected[1])["summary"], "")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(marked.read_bytes()),
                                                       encoding="utf-8"))
    assert run(lint_main, ["-", "--format", "json"], capsys)[1].replace("<stdin>", str(plain)) \
        == expected[1]
    fixed, fixed_plain = tmp_path / "f.jsonl", tmp_path / "fp.jsonl"
    assert run(fix_main, [str(marked), "-o", str(fixed)], capsys)[0] == 0
    assert run(fix_main, [str(plain), "-o", str(fixed_plain)], capsys)[0] == 0
    assert fixed.read_bytes() == fixed_plain.read_bytes()


def _tier_log(path: Path) -> None:
    """Three Anthropic sessions of three turns: the time (every turn) and a customer tier
    (every session) in the system prompt, as the online learner first sees them without
    evidence (session 0 keeps its tier) and then with it (later sessions move theirs)."""
    lines = []
    for s in range(3):
        history: list[dict[str, Any]] = [{"role": "user", "content": f"Summarise case {s}"}]
        for t in range(3):
            system = [{"type": "text", "text": "You are a research assistant. Cite sources."},
                      {"type": "text", "text": f"Current date and time: 2026-11-0{s + 3}T"
                                               f"1{t}:2{s}:0{t}Z. Customer tier: gold-{s}."}]
            lines.append(json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 64,
                                     "system": system, "messages": history}) + "\n")
            history = [*history, {"role": "assistant", "content": f"turn {t}"},
                       {"role": "user", "content": "go on"}]
    path.write_text("".join(lines))


def test_online_fix_is_idempotent_and_never_moves_its_own_markers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fix --online` of its own output moved the markers it had written (they differ from
    the values session 0 kept): `[context:session_1]` went into a second context block as
    `session_1: [context:session_1].`, a name the first block already used. Now a marker is
    never a value: the second fix changes nothing, and every context value is a real one."""
    log, once, twice = tmp_path / "log.jsonl", tmp_path / "once.jsonl", tmp_path / "twice.jsonl"
    _tier_log(log)
    assert run(fix_main, [str(log), "--online", "-o", str(once)], capsys)[0] == 0
    assert run(fix_main, [str(once), "--online", "-o", str(twice)], capsys)[0] == 0
    assert twice.read_text() == once.read_text()
    originals = log.read_text()
    assert "session_1: gold-1\\n" in once.read_text()  # later sessions' tiers are moved
    for line in once.read_text().splitlines():
        body = json.loads(line)
        text = body["messages"][-1]["content"]
        blocks = text if isinstance(text, str) else "".join(b["text"] for b in text)
        values = [v for v in blocks.split("\n") if ": " in v]
        assert blocks.count("<context>") <= 1
        assert all("context:" not in v.split(": ", 1)[1] for v in values)
        assert all(v.split(": ", 1)[1] in originals for v in values)  # a value from the log


def test_records_of_a_json_array_are_located_at_their_own_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pretty-printed JSON array of requests: every request, SARIF result and error said
    line 1. The reference is where each record's opening brace stands in the file."""
    bodies = [dict(CLEAN, tools=[{"type": "function", "function": {"name": n}}
                                 for n in ("b", "a")], user=f"u{i}") for i in range(4)]
    path = tmp_path / "log.json"
    path.write_text("\n" + json.dumps(bodies, indent=2) + "\n")
    starts = [n for n, line in enumerate(path.read_text().splitlines(), start=1)
              if line == "  {"]
    assert len(starts) == len(bodies) and starts[0] == 3
    _, out, _ = run(lint_main, [str(path), "--format", "json"], capsys)
    assert [r["line"] for r in json.loads(out)["requests"]] == starts
    _, out, _ = run(lint_main, [str(path), "--format", "sarif"], capsys)
    located = {r["locations"][0]["physicalLocation"]["region"]["startLine"]
               for r in json.loads(out)["runs"][0]["results"]}
    assert located == set(starts)
    bodies[2]["messages"] = []
    path.write_text(json.dumps(bodies, indent=2))
    code, _, err = run(lint_main, [str(path)], capsys)
    assert code == 2 and err.startswith(f"prefixgate lint: {path}:{starts[2] - 1}: ")
    path.write_text(json.dumps(bodies))  # one line: every record is on line 1
    assert run(lint_main, [str(path)], capsys)[2].startswith(f"prefixgate lint: {path}:1: ")


def test_an_output_inside_the_log_directory_is_not_read_back(
        log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """CI that writes its report or fixed log into the directory it lints: the next run read
    that file as input (the JSON report: exit 2, "'messages' must be a non-empty list"; the
    fixed log: every request twice). The reference is the first run's output."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.jsonl").write_text("".join(log.read_text().splitlines(True)[:20]))
    report, fixed = logs / "report.json", logs / "fixed.jsonl"
    first = run(lint_main, [str(logs), "--format", "json", "-o", str(report)], capsys)[0]
    first_report = report.read_text()
    assert run(lint_main, [str(logs), "--format", "json", "-o", str(report)], capsys)[0] == first
    assert report.read_text() == first_report
    report.unlink()
    assert run(fix_main, [str(logs), "-o", str(fixed)], capsys)[0] == 0
    first_fixed = fixed.read_text()
    assert len(first_fixed.splitlines()) == 20
    assert run(fix_main, [str(logs), "-o", str(fixed)], capsys)[0] == 0
    assert fixed.read_text() == first_fixed


def test_lint_refuses_to_write_its_report_over_an_input(
        log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lint LOG -o LOG` replaced the log with its report (exit 1, the log gone); now exit 2
    before any work and the log is intact. `fix LOG -o LOG` still rewrites LOG in place."""
    path = tmp_path / "log.jsonl"
    path.write_text("".join(log.read_text().splitlines(True)[:10]))
    before = path.read_bytes()
    code, out, err = run(lint_main, [str(path), "-o", str(tmp_path / "." / "log.jsonl")], capsys)
    assert (code, out) == (2, "") and path.read_bytes() == before
    assert err == (f"prefixgate lint: {tmp_path / '.' / 'log.jsonl'}: cannot write: "
                   "it is an input (the report would replace it)\n")
    expected = tmp_path / "expected.jsonl"
    assert run(fix_main, [str(path), "-o", str(expected)], capsys)[0] == 0
    assert run(fix_main, [str(path), "-o", str(path)], capsys)[0] == 0
    assert path.read_bytes() == expected.read_bytes()


def _interleaved_log(path: Path, provider: str) -> list[int]:
    """Three conversations of one agent that open with the same message, their turns
    interleaved as concurrent users' are in a log; each system prompt carries the time
    and the session's own id (a request id or a user handle). Returns each line's session."""
    sessions = {s: [{"role": "user", "content": "What's the weather in Paris?"}]
                for s in range(3)}
    lines, owners = [], []
    for t in range(3):
        for s in range(3):
            ident = (f"{s:08x}-1c2d-4e5f-8a9b-{s * 7919:012x}" if provider == "anthropic"
                     else f"user_{s * 104729:06x}")
            system = (f"Today is 2026-11-0{s + 3}T1{t}:0{s}:00Z. Request id: {ident}.\n"
                      if provider == "anthropic" else
                      f"Current time: 2026-11-0{s + 3}T1{t}:0{s}:00Z\nSession user: {ident}\n")
            system += "You are a travel agent assistant. Use tools when needed."
            body: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 64,
                                    "system": system, "messages": sessions[s]} \
                if provider == "anthropic" else \
                {"model": "gpt-4o", "messages": [{"role": "system", "content": system},
                                                 *sessions[s]]}
            lines.append(json.dumps(body) + "\n")
            owners.append(s)
            sessions[s] = [*sessions[s], {"role": "assistant", "content": f"s{s} turn {t}"},
                           {"role": "user", "content": f"and then {t}?"}]
    path.write_text("".join(lines))
    return owners


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
def test_fix_never_gives_one_conversation_another_ones_context(
        tmp_path: Path, provider: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Interleaved conversations that open alike share a remembered-turn key: `fix` gave
    session 0's history the context block session 2 got (its request id or user handle, its
    time), and session 0's second request no longer began with its first. References: the
    values each session's own requests carry, and each session's previous fixed request."""
    log, out = tmp_path / "log.jsonl", tmp_path / "fixed.jsonl"
    owners = _interleaved_log(log, provider)
    originals = log.read_text().splitlines()
    assert run(fix_main, [str(log), "-o", str(out)], capsys)[0] == 0
    fixed = [json.loads(line) for line in out.read_text().splitlines()]
    own = {s: "".join(o for o, w in zip(originals, owners, strict=True) if w == s)
           for s in set(owners)}
    previous: dict[int, list[Any]] = {}
    moved = 0
    for body, s in zip(fixed, owners, strict=True):
        for block in re.findall(r"<context>\\n(.*?)</context>", json.dumps(body)):
            for entry in block.split("\\n"):
                if entry:
                    moved += 1
                    assert entry.split(": ", 1)[1] in own[s], (s, entry)
        if s in previous:
            assert body["messages"][:len(previous[s])] == previous[s]
        previous[s] = body["messages"]
    assert moved >= 2 * len(fixed)  # the time and the id of every request were moved


class _Terminal(io.StringIO):
    """stderr as a terminal."""

    def isatty(self) -> bool:
        return True


def test_long_work_shows_progress_on_a_terminal_only(
        log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A large log was linted in silence (tens of seconds for tens of MB). On a terminal a
    progress line counts the requests of each pass and is erased at the end; the report is
    the one a pipe gets, and a pipe gets no progress (the reference: the run without a
    terminal)."""
    path = tmp_path / "log.jsonl"
    path.write_text("".join(log.read_text().splitlines(True)[:12]))
    code, expected, err = run(lint_main, [str(path), "--format", "json"], capsys)
    assert err == ""
    terminal = _Terminal()
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert run(lint_main, [str(path), "--format", "json"], capsys)[:2] == (code, expected)
    shown = terminal.getvalue()
    # the first reading counts the requests (the log is not held, so no total yet)
    assert [f"prefixgate: {what} {n}{of} requests" in shown for what, of in
            (("learning from", ""), ("linting", "/12")) for n in (0, 11)] == [True] * 4
    assert shown.endswith("\r") and shown.rsplit("\r", 2)[1].strip() == ""  # erased
    terminal.truncate(0)
    assert run(fix_main, [str(path), "-o", str(tmp_path / "f.jsonl")], capsys)[0] == 0
    assert "prefixgate: rewriting 11/12 requests" in terminal.getvalue()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("stdout", ["full", "closed"])
def test_a_stdout_that_cannot_be_written_is_one_line_and_exit_two(
        tmp_path: Path, stdout: str) -> None:
    """The real command with its report going to a full disk (`> report.txt`; /dev/full
    here) or to a closed descriptor: an OSError / AttributeError traceback and exit 1, a
    finding to CI, before; now one `<stdout>: cannot write` line and exit 2, as for `-o`."""
    src = tmp_path / "log.jsonl"
    src.write_text(json.dumps(CLEAN) + "\n")
    reason = {"full": "No space left on device", "closed": "stdout is closed"}[stdout]
    for argv in (["lint", str(src), "--fail-on", "never"], ["fix", str(src), "-o", "-"]):
        command = [sys.executable, "-m", "gateway.cli", *argv]
        if stdout == "full":
            with open("/dev/full", "w") as full:
                proc = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True,
                                      timeout=120, cwd=ROOT)
        else:
            proc = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *command],
                                  stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
        prog = f"prefixgate {argv[0]}"
        assert (proc.returncode, proc.stderr) == (2, f"{prog}: <stdout>: cannot write: {reason}\n")


def test_a_closed_stdin_is_bad_input(tmp_path: Path) -> None:
    """`prefixgate lint -` started with stdin closed (`<&-`): an AttributeError traceback
    and exit 1 (a finding, to CI) before; now one line and exit 2."""
    proc = subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh", sys.executable, "-m",
                           "gateway.cli", "lint", "-"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (proc.returncode, proc.stdout, proc.stderr) == \
        (2, "", "prefixgate lint: <stdin>: cannot read: stdin is closed\n")
