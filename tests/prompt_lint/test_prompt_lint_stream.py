"""`prefixgate lint` / `fix` read the log twice from disk instead of holding it: the reports
and fixed logs are byte for byte what the in-memory path wrote, and memory does not grow with
the log.

The reference is the in-memory path as it was: `load_requests` (every body held), learn,
freeze, lint, then render / rewrite and join (`_reference_lint`, `_reference_fix` below)."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prompt_lint import cli
from prompt_lint.cli import fix_main, lint_main
from prompt_lint.lint import first_turn, learn_request, lint_request
from prompt_lint.loader import InputError, LoadedRequest, Skipped, load_requests
from prompt_lint.output import render
from prompt_lint.rewrite import rewrite_request
from prompt_lint.stream import LogSource
from prompt_lint.templates import TemplateLearner
from prompt_lint.types import LintReport

from .test_prompt_lint_cli import ROOT, _sessions_log
from .test_prompt_lint_skip_invalid import SYSTEM, _good_and_bad

CLEAN_REQUEST = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
USERS = ["user_44cb63", "user_204f89", "user_829868", "user_3c5fd7", "user_91aa02"]


def _reference(inputs: list[str], lenient: bool, stdin: bytes | None = None
               ) -> tuple[list[LoadedRequest], list[LintReport], TemplateLearner,
                          list[Skipped]] | str:
    """The in-memory two-pass lint of `inputs` as `prefixgate lint` ran it; or the error."""
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    skipped: list[Skipped] = []
    try:
        requests = load_requests(inputs, skipped=skipped if lenient else None)
    except InputError as exc:
        return str(exc)
    learner = TemplateLearner()
    sessions = [(learn_request(r.body, learner, r.provider), first_turn(r.body))
                for r in requests]
    learner.freeze()
    left = Counter(sessions)
    reports = []
    for req, session in zip(requests, sessions, strict=True):
        left[session] -= 1
        reports.append(lint_request(req.body, req.provider, learner=learner,
                                    session_continues=left[session] > 0))
    return requests, reports, learner, skipped


def _reference_lint(inputs: list[str], fmt: str, lenient: bool = False,
                    stdin: bytes | None = None) -> str:
    done = _reference(inputs, lenient, stdin)
    assert not isinstance(done, str), done
    requests, reports, _, skipped = done
    return render(fmt, requests, reports, True, skipped)


def _reference_fix(inputs: list[str], out: str, stdin: bytes | None = None) -> bytes:
    done = _reference(inputs, False, stdin)
    assert not isinstance(done, str), done
    requests, reports, learner, _ = done
    records = [req.with_body(rewrite_request(req.body, req.provider, report=rep,
                                             learner=learner).body)
               for req, rep in zip(requests, reports, strict=True)]
    if out.removesuffix(".gz").endswith(".json"):
        doc: Any = records[0] if len(records) == 1 else records
        text = json.dumps(doc, ensure_ascii=False, indent=2) + "\n"
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    data = text.encode("utf-8")
    return gzip.compress(data, mtime=0) if out.endswith(".gz") else data


def _logs(tmp: Path) -> dict[str, tuple[list[str], bytes | None, bool]]:
    """name: (inputs, stdin bytes, lenient) for each kind of log."""
    plain = tmp / "plain.jsonl"
    _sessions_log(plain, SYSTEM, USERS)
    body = plain.read_bytes()
    packed = tmp / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(body))
    records = [json.loads(line) for line in body.splitlines()]
    array = tmp / "array.json"
    array.write_text(json.dumps(records, indent=2))
    one_line = tmp / "one_line.json"
    one_line.write_text("\n\n" + json.dumps(records) + "\n")
    single = tmp / "single.json"
    single.write_text(json.dumps({"request": records[0], "response": {"id": "r1"}}, indent=1))
    envelopes = tmp / "dir" / "envelopes.jsonl"
    envelopes.parent.mkdir()
    envelopes.write_text("\ufeff" + "".join(  # a BOM, raw U+2028 in a string, CRLF ends
        json.dumps({"request": {**r, "metadata": {"note": "a\u2028b"}}, "id": n},
                   ensure_ascii=False) + "\r\n" for n, r in enumerate(records)))
    _, mixed, _ = _good_and_bad(tmp)
    cut = tmp / "cut.jsonl"  # a log still being written: a half line at its end
    cut.write_bytes(body + body[:40])
    return {"jsonl": ([str(plain)], None, False), "gzip": ([str(packed)], None, False),
            "array": ([str(array)], None, False), "one-line": ([str(one_line)], None, False),
            "single": ([str(single)], None, False),
            "dir+files": ([str(envelopes.parent), str(plain), str(array)], None, False),
            "skip-invalid": ([str(mixed), str(cut)], None, True),
            "stdin": (["-"], packed.read_bytes(), False),
            "stdin+file": ([str(plain), "-"], body, False)}


KINDS = ["jsonl", "gzip", "array", "one-line", "single", "dir+files", "skip-invalid", "stdin",
         "stdin+file"]


def _run(main: Callable[[list[str]], int], argv: list[str], stdin: bytes | None,
         capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
         ) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", KINDS)
def test_reports_are_the_in_memory_reports(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    inputs, stdin, lenient = _logs(tmp_path)[kind]
    flags = ["--skip-invalid"] if lenient else []
    for fmt in ("text", "json", "sarif", "github"):
        code, out, err = _run(lint_main, [*inputs, "--format", fmt, "--show-values",
                                          "--fail-on", "never", *flags], stdin, capsys,
                              monkeypatch)
        want = _reference_lint(inputs, fmt, lenient, stdin)
        assert (code, out) == (0, want), fmt
        assert ("(skipped)" in err) == lenient
    if lenient:  # the stderr notes: the same records, lines and order as the JSON report
        notes = [f"prefixgate lint: {s['problem']} (skipped)"
                 for s in json.loads(_reference_lint(inputs, "json", True))["skipped"]]
        assert err.splitlines() == notes and len(notes) > 4


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "skip-invalid"])
@pytest.mark.parametrize("name", ["fixed.jsonl", "fixed.json", "fixed.jsonl.gz",
                                  "fixed.json.gz", "-"])
def test_fixed_logs_are_the_in_memory_ones_byte_for_byte(
        kind: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    inputs, stdin, _ = _logs(tmp_path)[kind]
    out = name if name == "-" else str(tmp_path / name)
    code, printed, err = _run(fix_main, [*inputs, "-o", out], stdin, capsys, monkeypatch)
    assert code == 0 and err.startswith("prefixgate fix: ")
    got = printed.encode("utf-8") if name == "-" else Path(out).read_bytes()
    assert got == _reference_fix(inputs, "fixed.jsonl" if name == "-" else out, stdin)


@pytest.mark.parametrize("name", ["plain.jsonl", "packed.jsonl.gz", "array.json"])
def test_fix_in_place_writes_over_its_input_only_after_reading_it(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`fix IN -o IN`: the second reading reads IN while `fix` writes; IN was truncated
    under it (found no requests, or half)."""
    path = tmp_path / name
    _logs(tmp_path)
    want = _reference_fix([str(path)], str(path))
    alias = tmp_path / "alias"
    alias.hardlink_to(path)  # the same file under another name
    assert _run(fix_main, [str(alias), "-o", str(path)], None, capsys, monkeypatch)[0] == 0
    assert path.read_bytes() == want


def _broken(tmp: Path) -> dict[str, list[str]]:
    """Inputs with more than one problem: the error named is the one load_requests named
    (a file's problem before any record's, whichever file comes first)."""
    good = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    (tmp / "bad_json.jsonl").write_text(good + "\n{oops\n" + good + "\n")
    (tmp / "late_latin1.jsonl").write_bytes(f"{good}\n{{\"x\": 1}}\n".encode() +
                                            b'{"a": "caf\xe9"}\n')
    (tmp / "cut.jsonl.gz").write_bytes(gzip.compress((good + "\n").encode() * 50)[:-30])
    (tmp / "nan_first.json").write_text('[{"a": NaN},\n' + good + "]\n")
    (tmp / "deep.jsonl").write_text("[" * 2000 + "\n" + good + "\n")
    (tmp / "responses.jsonl").write_text('{"object": "response"}\n')
    paths = {k: str(tmp / k) for k in ("bad_json.jsonl", "late_latin1.jsonl", "cut.jsonl.gz",
                                       "nan_first.json", "deep.jsonl", "responses.jsonl")}
    return {"record then latin-1": [paths["bad_json.jsonl"], paths["late_latin1.jsonl"]],
            "latin-1 late in the file": [paths["late_latin1.jsonl"]],
            "record then cut gzip": [paths["bad_json.jsonl"], paths["cut.jsonl.gz"]],
            "record then missing": [paths["responses.jsonl"], str(tmp / "missing.jsonl")],
            "nan in a document": [paths["nan_first.json"]],
            "deep first line": [paths["deep.jsonl"]],
            "nothing": [str(tmp / "dir_without_logs")]}


@pytest.mark.parametrize("lenient", [False, True], ids=["strict", "skip-invalid"])
@pytest.mark.parametrize("case", ["record then latin-1", "latin-1 late in the file",
                                  "record then cut gzip", "record then missing",
                                  "nan in a document", "deep first line", "nothing"])
def test_bad_input_is_refused_as_before(
        case: str, lenient: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dir_without_logs").mkdir()
    inputs = _broken(tmp_path)[case]
    flags = ["--skip-invalid"] if lenient else []
    code, out, err = _run(lint_main, [*inputs, "--format", "json", "--show-values", *flags],
                          None, capsys, monkeypatch)
    skipped: list[Skipped] = []
    try:
        load_requests(inputs, skipped=skipped if lenient else None)
    except InputError as exc:
        want = "".join(f"prefixgate lint: {k.message} (skipped)\n" for k in skipped) + \
            f"prefixgate lint: {exc}\n"
        assert (code, out, err) == (2, "", want)
        return
    assert lenient and code in (0, 1)  # what the reference reads, the lint reads
    assert out == _reference_lint(inputs, "json", True)


def test_progress_of_the_first_reading_counts_without_a_total(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--online reads the log through first too (a bad record refuses it before any lint)."""
    inputs = _logs(tmp_path)["jsonl"][0]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    terminal = Terminal()
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert _run(lint_main, [*inputs, "--online", "--fail-on", "never"], None, capsys,
                monkeypatch)[0] == 0
    shown = terminal.getvalue()
    assert "prefixgate: reading 14 requests" in shown
    assert "prefixgate: linting 14/15 requests" in shown


#: The child's peak resident memory (kB on Linux), printed after the command ran. The process
#: memos are held to small budgets first: they fill up to theirs (124 MiB in all, bounded by
#: bytes whatever the log, tested in test_prompt_lint_memory), which a log of a few MB does not.
_PEAK = ("import resource, sys\n"
         "from prompt_lint.budgets import MemoBudgets\n"
         "from prompt_lint.memory import apply_budgets\n"
         "apply_budgets(MemoBudgets(*[64 << 10] * 9))\n"
         "from prompt_lint.cli import {main}\n"
         "code = {main}(sys.argv[1:])\n"
         "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")


def _big_log(path: Path, requests: int) -> None:
    """Agent sessions of ~20 kB requests (a long system prompt shared by the family, the
    time and a user id on top, a growing history)."""
    system = "\n".join(f"Rule {k}: answer briefly and cite the policy section {k}." * 3
                       for k in range(120))
    with path.open("w") as out:
        for n in range(requests):
            s, turn = divmod(n, 6)
            messages = [{"role": "system", "content": f"Time: 2026-12-0{1 + n % 9}T10:{n % 60:02}"
                         f":00Z\nuser_id: u_{s:05}\n{system}"}]
            for k in range(turn + 1):
                messages += [{"role": "user", "content": f"Question {k} of session {s}"},
                             {"role": "assistant", "content": f"Answer {k}"}]
            out.write(json.dumps({"model": "gpt-4o", "messages": messages[:-1]}) + "\n")


def _peak_kb(main: str, argv: list[str]) -> int:
    proc = subprocess.run([sys.executable, "-c", _PEAK.format(main=main), *argv],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode in (0, 1), proc.stderr
    return int(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("main", ["lint_main", "fix_main"])
def test_memory_does_not_grow_with_the_log(main: str, tmp_path: Path) -> None:
    """Peak RSS of the command on a log and on one twice its size (6 and 12 MB): the
    in-memory path grew by 4 (lint) and 6 (fix) times the extra megabytes (bodies parsed, rewritten,
    joined); reading the log twice grows by far less than the extra log. The lint keeps one
    report per request for its output (the text report here: about 3% of this log; the
    JSON report, with its indentation, is 8% and takes about four times that to render)."""
    peaks, sizes = [], []
    for requests in (300, 600):
        log = tmp_path / f"log{requests}.jsonl"
        _big_log(log, requests)
        out = ["-o", str(tmp_path / "fixed.jsonl")] if main == "fix_main" else \
            ["--format", "text", "-o", str(tmp_path / "report.txt")]
        peaks.append(_peak_kb(main, [str(log), *out]) * 1024)
        sizes.append(log.stat().st_size)
    grew, extra = peaks[1] - peaks[0], sizes[1] - sizes[0]
    assert extra > 5_000_000
    assert grew < extra / 4, (grew, extra)


@pytest.mark.parametrize("name", ["plain.jsonl", "packed.jsonl.gz"])
def test_a_log_still_being_written_is_read_as_far_as_the_first_reading_read(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines written to the log between the two readings (the second reads it from disk
    again) are not read: the report is the one for the log as the first reading found it."""
    _logs(tmp_path)
    path = tmp_path / name
    want = _reference_lint([str(path)], "json")
    replay = LogSource.replay

    def grow_then_replay(self: LogSource) -> Any:
        more = json.dumps(CLEAN_REQUEST) + "\n" + json.dumps(CLEAN_REQUEST)[:30]
        if name.endswith(".gz"):  # a second gzip member, as `gzip >>` appends
            path.write_bytes(path.read_bytes() + gzip.compress(more.encode()))
        else:
            with path.open("a") as log:
                log.write(more)
        return replay(self)
    monkeypatch.setattr(LogSource, "replay", grow_then_replay)
    code, out, _ = _run(lint_main, [str(path), "--format", "json", "--show-values",
                                    "--fail-on", "never"], None, capsys, monkeypatch)
    assert (code, out) == (0, want)
