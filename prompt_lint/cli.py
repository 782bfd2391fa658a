"""`prefixgate lint` and `prefixgate fix`.

lint: exit 0 when no finding reaches `--fail-on`, 1 when one does, 2 on bad
input or an output that cannot be written (one `file[:line]: problem` line on
stderr, nothing else printed; never a traceback, whose exit status 1 would read
as a finding). `lint --skip-invalid` lints what it can read instead: each record
left out is one `file:line: problem (skipped)` line on stderr and a `skipped`
entry in the JSON report (a tool notification in SARIF). fix: writes the
rewritten requests as JSONL, or as one JSON document when OUT ends in .json
(the object for one request, else an array); a request read from an envelope
(`{"request": {...}, "response": {...}}`) is written back in its envelope, with
only the body rewritten; it refuses bad input whole (a fixed log holds every
record or none). Both learn templates over the whole log first (two passes),
unless `--online` asks for the one-pass behaviour a gateway has.
"""

from __future__ import annotations

import argparse
import errno
import gzip
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from prompt_lint.lint import first_turn, learn_request, lint_request
from prompt_lint.loader import InputError, LoadedRequest, Skipped, load_requests
from prompt_lint.output import render
from prompt_lint.rewrite import rewrite_request
from prompt_lint.rules import SEVERITY_RANK
from prompt_lint.templates import TemplateLearner
from prompt_lint.tokens import DEFAULT_ENCODING, get_encoding
from prompt_lint.types import LintReport

T = TypeVar("T")


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (0 or less was a ValueError traceback from the
    learner, exit 1, which CI reads as a finding); else argparse's usage error, exit 2."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="JSONL / JSON files or directories ('-' = stdin)")
    parser.add_argument("--provider", choices=["openai", "anthropic"],
                        help="request format (default: detect per request)")
    parser.add_argument("--encoding", default=DEFAULT_ENCODING,
                        help=f"tiktoken encoding for token counts (default {DEFAULT_ENCODING})")
    parser.add_argument("--online", action="store_true",
                        help="learn templates one request at a time (as the gateway does)")
    parser.add_argument("--max-families", type=_positive_int, default=256,
                        help="bound on learned prompt families")


def _lint_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate lint",
                                     description="Find prefix-cache killers in request logs.")
    _common(parser)
    parser.add_argument("--format", choices=["text", "json", "sarif", "github"], default="text",
                        help="github: GitHub Actions annotations (workflow commands)")
    parser.add_argument("--fail-on", choices=["error", "warning", "info", "never"],
                        default="error", help="exit 1 when a finding is at least this severe")
    parser.add_argument("--show-values", action="store_true", help="print raw values")
    parser.add_argument("-o", "--output", help="write the report here instead of stdout")
    parser.add_argument("--skip-invalid", action="store_true",
                        help="leave out records that are not valid requests (each named on "
                             "stderr) and lint the rest, instead of refusing the whole input")
    return parser


def _fix_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate fix",
                                     description="Rewrite request logs stable-first.")
    _common(parser)
    parser.add_argument("-o", "--output", required=True, help="output file ('-' = stdout)")
    return parser


#: Seconds before the progress line first shows, and between two redraws of it.
PROGRESS_EVERY_S = 1.0


def _progress(items: list[T], what: str) -> Iterator[T]:
    """`items`, one by one; on a terminal, a `prefixgate: linting 1200/5000 requests` line on
    stderr, redrawn at most every `PROGRESS_EVERY_S` once the work has taken that long and
    erased at the end (a log of tens of MB takes tens of seconds, which were silent). Not on
    a pipe or a file: a CI log gets no carriage returns."""
    tty = sys.stderr.isatty()
    last = time.monotonic()
    shown = 0
    for n, item in enumerate(items):
        if tty and (now := time.monotonic()) - last >= PROGRESS_EVERY_S:
            line = f"\rprefixgate: {what} {n}/{len(items)} requests"
            sys.stderr.write(line)
            sys.stderr.flush()
            last, shown = now, max(shown, len(line) - 1)
        yield item
    if shown:
        sys.stderr.write("\r" + " " * shown + "\r")
        sys.stderr.flush()


def _lint_all(requests: list[LoadedRequest], args: argparse.Namespace,
              learner: TemplateLearner) -> list[LintReport]:
    """Each request linted; two passes (learn the whole log, then lint) unless `--online`.
    With the whole log read first, a request knows whether its session (prompt family and
    first turn) sends another one later: its session-scoped values are then reused, not
    lost (`lint_request`'s `session_continues`)."""
    if args.online:
        return [lint_request(req.body, req.provider, learner=learner, encoding=args.encoding)
                for req in _progress(requests, "linting")]
    sessions = [(learn_request(req.body, learner, req.provider), first_turn(req.body))
                for req in _progress(requests, "learning from")]
    learner.freeze()
    left = Counter(sessions)
    reports = []
    for req, session in zip(_progress(requests, "linting"), sessions, strict=True):
        left[session] -= 1
        reports.append(lint_request(req.body, req.provider, learner=learner,
                                    encoding=args.encoding, session_continues=left[session] > 0))
    return reports


class Prepared(NamedTuple):
    """A command's parsed arguments, the requests it read and the records it left out (only
    with `--skip-invalid`)."""

    args: argparse.Namespace
    requests: list[LoadedRequest]
    skipped: list[Skipped]


#: Left-out records named on stderr one by one; the rest are counted in one line.
SKIPPED_SHOWN = 20


def _prepare(parser: argparse.ArgumentParser, argv: list[str], report: bool) -> Prepared | int:
    """Parsed arguments and the loaded requests, or 2 after one error line. `report`: the
    output is a report, never to be written over an input."""
    args = parser.parse_args(argv)
    skipped: list[Skipped] = []
    try:
        get_encoding(args.encoding)
        _check_output(args.output, args.inputs if report else [])
        requests = load_requests(args.inputs, args.provider, skip=args.output,
                                 skipped=skipped if getattr(args, "skip_invalid", False) else None)
    except (InputError, ValueError) as exc:
        _tell_skipped(parser.prog, skipped)
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    _tell_skipped(parser.prog, skipped)
    return Prepared(args, requests, skipped)


def _tell_skipped(prog: str, skipped: list[Skipped]) -> None:
    """One stderr line per left-out record, the first `SKIPPED_SHOWN` of them, then a count
    (a pretty-printed JSON file that does not parse is judged line by line: one per line)."""
    for item in skipped[:SKIPPED_SHOWN]:
        print(f"{prog}: {item.message} (skipped)", file=sys.stderr)
    if len(skipped) > SKIPPED_SHOWN:
        print(f"{prog}: ... and {len(skipped) - SKIPPED_SHOWN} more records skipped "
              f"({len(skipped)} in all)", file=sys.stderr)


def _check_output(path: str | None, inputs: list[str]) -> None:
    """Refuse an output path that is a directory, in no directory, or one of the files in
    `inputs` (lint's: a report written over the log it read lost the log) before the work (a
    typo should not cost a lint of the whole log); `_write` reports what this cannot see
    (permissions, a full disk). `fix IN -o IN` rewrites IN in place, as asked."""
    if path is None or path == "-":
        return
    if Path(path).is_dir():
        raise InputError(f"{path}: cannot write: Is a directory")
    if not Path(path).parent.is_dir():
        raise InputError(f"{path}: cannot write: No such directory")
    target = Path(path).resolve()
    if any(name != "-" and Path(name).resolve() == target for name in inputs):
        raise InputError(f"{path}: cannot write: it is an input (the report would replace it)")


def _write(prog: str, path: str | None, text: str) -> bool:
    """Write `text` to `path` (stdout for None or "-"; gzipped for a name ending in .gz);
    False, after one error line on stderr, when the file cannot be written."""
    if path is None or path == "-":
        return _write_stdout(prog, text)
    data = text.encode("utf-8")
    try:  # a name ending in .gz is written gzipped, as such an input is read
        Path(path).write_bytes(gzip.compress(data, mtime=0) if path.endswith(".gz") else data)
    except OSError as exc:
        print(f"{prog}: {path}: cannot write: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True


def _write_stdout(prog: str, text: str) -> bool:
    """Write `text` to stdout; False, after one error line on stderr, when stdout cannot take
    it (a full disk under `> report.txt`, a closed descriptor), as for an `-o` file: it was a
    traceback and exit 1, a finding to CI. stdout is then pointed at the null device, so that
    the interpreter's exit does not fail flushing it again (exit status 120)."""
    try:
        if sys.stdout is None:  # started with its descriptor closed
            raise OSError(errno.EBADF, "stdout is closed")
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        print(f"{prog}: <stdout>: cannot write: {exc.strerror or exc}", file=sys.stderr)
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives to exit
        return False
    return True


def _fixed_text(records: list[dict[str, Any]], path: str) -> str:
    """What `fix` writes: one JSON document when `path` ends in .json (the record itself when
    there is one, else an array: JSONL in a .json file was read by no JSON tool), else JSONL."""
    if not path.removesuffix(".gz").endswith(".json"):
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    document: Any = records[0] if len(records) == 1 else records
    return json.dumps(document, ensure_ascii=False, indent=2) + "\n"


def lint_main(argv: list[str]) -> int:
    """`prefixgate lint`: report findings; exit 0 clean, 1 findings, 2 bad input or output."""
    parser = _lint_parser()
    prepared = _prepare(parser, argv, report=True)
    if isinstance(prepared, int):
        return prepared
    args, requests, skipped = prepared
    reports = _lint_all(requests, args, TemplateLearner(max_families=args.max_families))
    if not _write(parser.prog, args.output,
                  render(args.format, requests, reports, args.show_values, skipped)):
        return 2
    if args.fail_on == "never":
        return 0
    floor = SEVERITY_RANK[args.fail_on]
    failed = any(SEVERITY_RANK[f.severity] >= floor for r in reports for f in r.findings)
    return 1 if failed else 0


def fix_main(argv: list[str]) -> int:
    """`prefixgate fix IN -o OUT`: write rewritten requests; exit 2 on bad input or output."""
    parser = _fix_parser()
    prepared = _prepare(parser, argv, report=False)
    if isinstance(prepared, int):
        return prepared
    args, requests, _ = prepared
    learner = TemplateLearner(max_families=args.max_families)
    reports = _lint_all(requests, args, learner)
    results = [rewrite_request(req.body, req.provider, report=rep, learner=learner)
               for req, rep in _progress(list(zip(requests, reports, strict=True)),
                                         "rewriting")]
    records = [req.with_body(r.body) for req, r in zip(requests, results, strict=True)]
    if not _write(parser.prog, args.output, _fixed_text(records, args.output)):
        return 2
    changed = sum(r.changed for r in results)
    moved = sum(len(r.moved) for r in results)
    print(f"prefixgate fix: {len(results)} requests, {changed} rewritten, {moved} values moved "
          "into context blocks", file=sys.stderr)
    return 0
