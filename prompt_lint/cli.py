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
unless `--online` asks for the one-pass behaviour a gateway has. The log is read twice
(`stream.LogSource`), never held whole: the first reading checks and learns it, keeping per
request only its session key; the second lints it, and `fix` writes each record as it is
rewritten.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar

from prompt_lint.lint import first_turn, learn_request, lint_request
from prompt_lint.loader import InputError, LoadedRequest, Skipped
from prompt_lint.output import Where, render_pieces
from prompt_lint.rewrite import rewrite_request
from prompt_lint.rules import SEVERITY_RANK
from prompt_lint.sink import FixedOutput, TextSink, write_pieces
from prompt_lint.stream import LogSource
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

#: A request's session in a two-pass lint: its prompt family and its first turn's fingerprint.
Session = tuple[str | None, str]


def _progress(items: Iterable[T], what: str, total: int | None = None) -> Iterator[T]:
    """`items`, one by one; on a terminal, a `prefixgate: linting 1200/5000 requests` line on
    stderr (`learning from 1200 requests` while the first reading has no total yet), redrawn
    at most every `PROGRESS_EVERY_S` once the work has taken that long and erased at the end
    (a log of tens of MB takes tens of seconds, which were silent). Not on a pipe or a file:
    a CI log gets no carriage returns."""
    tty = sys.stderr.isatty()
    last = time.monotonic()
    shown = 0
    of = "" if total is None else f"/{total}"
    for n, item in enumerate(items):
        if tty and (now := time.monotonic()) - last >= PROGRESS_EVERY_S:
            line = f"\rprefixgate: {what} {n}{of} requests"
            sys.stderr.write(line)
            sys.stderr.flush()
            last, shown = now, max(shown, len(line) - 1)
        yield item
    if shown:
        sys.stderr.write("\r" + " " * shown + "\r")
        sys.stderr.flush()


def _learn_all(source: LogSource, args: argparse.Namespace,
               learner: TemplateLearner) -> list[Session] | None:
    """The first reading: every request checked and (two-pass) learned; its session kept (a
    small tuple, not its body). None with `--online`, which learns while it lints."""
    if args.online:
        for _ in _progress(source.scan(), "reading"):
            pass
        return None
    sessions = [(learn_request(req.body, learner, req.provider), first_turn(req.body))
                for req in _progress(source.scan(), "learning from")]
    learner.freeze()
    return sessions


def _lint_all(source: LogSource, sessions: list[Session] | None, args: argparse.Namespace,
              learner: TemplateLearner, what: str = "linting"
              ) -> Iterator[tuple[LoadedRequest, LintReport]]:
    """The second reading: each request with its report. Two-pass (`sessions`), a request
    knows whether its session (prompt family and first turn) sends another one later: its
    session-scoped values are then reused, not lost (`lint_request`'s `session_continues`)."""
    requests = _progress(source.replay(), what, source.count)
    if sessions is None:
        for req in requests:
            yield req, lint_request(req.body, req.provider, learner=learner,
                                    encoding=args.encoding)
        return
    left = Counter(sessions)
    for req, session in zip(requests, sessions, strict=True):
        left[session] -= 1
        yield req, lint_request(req.body, req.provider, learner=learner,
                                encoding=args.encoding, session_continues=left[session] > 0)


class Prepared(NamedTuple):
    """A command's parsed arguments, its log (read through once) and learner, and each
    request's session (None with `--online`)."""

    args: argparse.Namespace
    source: LogSource
    learner: TemplateLearner
    sessions: list[Session] | None


#: Left-out records named on stderr one by one; the rest are counted in one line.
SKIPPED_SHOWN = 20


def _prepare(parser: argparse.ArgumentParser, argv: list[str], report: bool) -> Prepared | int:
    """Parsed arguments and the log read through once (checked, and learned from unless
    `--online`), or 2 after one error line. `report`: the output is a report, never to be
    written over an input."""
    args = parser.parse_args(argv)
    source: LogSource | None = None
    learner = TemplateLearner(max_families=args.max_families)
    try:
        get_encoding(args.encoding)
        _check_output(args.output, args.inputs if report else [])
        source = LogSource(args.inputs, args.provider, skip=args.output,
                           lenient=getattr(args, "skip_invalid", False))
        sessions = _learn_all(source, args, learner)
    except (InputError, ValueError) as exc:
        if source is not None:
            source.close()
            _tell_skipped(parser.prog, source.skipped)
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    _tell_skipped(parser.prog, source.skipped)
    return Prepared(args, source, learner, sessions)


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
    typo should not cost a lint of the whole log); the writing reports what this cannot see
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


def _is_input(path: str, source: LogSource) -> bool:
    """Whether `path` is one of the files `source` reads (then `fix` writes over it only once
    the second reading is done)."""
    if path == "-" or not Path(path).exists():
        return False
    return any(item.path is not None and item.spool is None and os.path.samefile(item.path, path)
               for item in source.inputs)


def lint_main(argv: list[str]) -> int:
    """`prefixgate lint`: report findings; exit 0 clean, 1 findings, 2 bad input or output."""
    parser = _lint_parser()
    prepared = _prepare(parser, argv, report=True)
    if isinstance(prepared, int):
        return prepared
    args, source, learner, sessions = prepared
    where: list[Where] = []
    reports: list[LintReport] = []
    with source:
        try:
            for req, rep in _lint_all(source, sessions, args, learner):
                where.append(Where(req.source, req.line))
                reports.append(rep)
        except InputError as exc:
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            return 2
    if not write_pieces(parser.prog, args.output, render_pieces(
            args.format, where, reports, args.show_values, source.skipped)):
        return 2
    if args.fail_on == "never":
        return 0
    floor = SEVERITY_RANK[args.fail_on]
    failed = any(SEVERITY_RANK[f.severity] >= floor for r in reports for f in r.findings)
    return 1 if failed else 0


def _rewrite_all(source: LogSource, prepared: Prepared, out: FixedOutput) -> Counts | None:
    """Each request linted, rewritten and written at once; None once the output failed."""
    args, _, learner, sessions = prepared
    changed = moved = 0
    for req, rep in _lint_all(source, sessions, args, learner, "rewriting"):
        result = rewrite_request(req.body, req.provider, report=rep, learner=learner)
        changed, moved = changed + result.changed, moved + len(result.moved)
        if not out.write(req.with_body(result.body)):
            return None
    return Counts(source.count, changed, moved)


class Counts(NamedTuple):
    """What `fix` did: requests read, requests rewritten, values moved."""

    requests: int
    changed: int
    moved: int


def fix_main(argv: list[str]) -> int:
    """`prefixgate fix IN -o OUT`: write rewritten requests; exit 2 on bad input or output."""
    parser = _fix_parser()
    prepared = _prepare(parser, argv, report=False)
    if isinstance(prepared, int):
        return prepared
    with prepared.source as source:
        output = prepared.args.output
        sink = TextSink(parser.prog, output, via_spool=_is_input(output, source))
        try:
            counts = _rewrite_all(source, prepared, FixedOutput(sink, source.count)) \
                if sink.open() else None
            if counts is None or not sink.close():
                return 2
        except InputError as exc:  # the log changed between the two readings
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            return 2
        finally:
            sink.discard()
    print(f"prefixgate fix: {counts.requests} requests, {counts.changed} rewritten, "
          f"{counts.moved} values moved out of the shared prefix", file=sys.stderr)
    return 0
