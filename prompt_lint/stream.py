"""Reading a request log twice without holding it: what `prefixgate lint` and `fix` read.

`load_requests` holds every file's text and every parsed body at once (a 200 MB log took a
gigabyte). A `LogSource` reads its inputs line by line instead, once to learn (`scan`) and
again to lint (`replay`), holding one record at a time: a JSONL file, gzipped or not, is read
from disk again in the second pass, up to the bytes the first pass read (a log still being
written has grown since); stdin, or a pipe named as a file, is copied to a temporary file
first (a text stdin, already held, is kept as it is). A file that is one JSON document (an
array or an object spread over lines, not JSONL) is still parsed whole, in each pass: a JSON
parser needs all of it.

What it reads, refuses and skips is what `load_requests` does (the same messages, at the same
lines, in the same order): a bad record is refused only once every input has been read far
enough to find a missing, unreadable, cut gzip or (strictly) non-UTF-8 one, which
`load_requests` reports first; a lenient scan orders its notes as `load_requests` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prompt_lint.loader import (
    InputError,
    LoadedRequest,
    Skipped,
    _document,
    _is_log_name,
    _loads,
    _parse,
    _records,
    _request,
)
from prompt_lint.providers import PROVIDERS
from prompt_lint.textlines import FileError, Input, Lines, spool_stdin, spooled

#: Where a note goes: a list's append, or nowhere (None: a strict read raises instead).
Note = Callable[[Skipped], None]


class LogSource:
    """The requests of `paths` ("-" is stdin), read twice; see the module docstring.
    `skip`: the command's own output, which a directory's walk leaves out. `lenient`: leave
    bad records out (`skipped`, in load_requests' order) instead of refusing the input."""

    def __init__(self, paths: list[str], provider: str | None = None,
                 skip: str | None = None, lenient: bool = False) -> None:
        if provider is not None and provider not in PROVIDERS:
            raise InputError(f"unknown provider {provider!r}; choose one of "
                             f"{', '.join(PROVIDERS)}")
        self.paths, self.provider, self.lenient = paths, provider, lenient
        self.own = Path(skip).resolve() if skip is not None and skip != "-" else None
        self.inputs: list[Input] = []  # read through, with the bytes read
        self.skipped: list[Skipped] = []
        self.count = 0
        self._utf8: list[tuple[int, Skipped]] = []  # (input, note) for lines not UTF-8
        self._bad: list[Skipped] = []  # records that are not requests
        self._spools: list[Input] = []

    def close(self) -> None:
        """Drop the copies of stdin."""
        for item in self._spools:
            if item.spool is not None:
                item.spool.close()

    def __enter__(self) -> LogSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scan(self) -> Iterator[LoadedRequest]:
        """First pass: every request, in order (counted in `count`); an InputError for bad
        input, after which `skipped` holds the notes load_requests would have told."""
        pending: InputError | None = None
        try:
            for path in self.paths:
                for item in self._expand(path):
                    index = len(self.inputs)
                    lines = Lines(item, self._utf8_note(index) if self.lenient else None)
                    if pending is None:
                        try:
                            for req in self._requests(item.source, lines, self._bad.append):
                                self.count += 1
                                yield req
                        except FileError:
                            raise
                        except InputError as exc:  # a strict read: refused once all is read
                            pending = exc
                    lines.drain()
                    self.inputs.append(item._replace(limit=lines.read))
        except FileError:
            self.skipped = [k for i, k in self._utf8 if i < len(self.inputs)]
            raise
        self.skipped = self._ordered()
        if pending is not None:
            raise pending
        if not self.count:
            raise InputError(f"no requests found in {', '.join(self.paths)}")

    def replay(self) -> Iterator[LoadedRequest]:
        """Second pass: the same requests again, read from the same bytes."""
        seen = 0
        for item in self.inputs:
            for req in self._requests(item.source, Lines(item, lambda _: None), lambda _: None):
                seen += 1
                yield req
        if seen != self.count:
            raise InputError(f"{', '.join(self.paths)}: changed while being read "
                             f"({self.count} requests, then {seen})")

    def _utf8_note(self, index: int) -> Note:
        """Where a lenient reading of input `index` notes a line that is not UTF-8."""
        return lambda item: self._utf8.append((index, item))

    def _ordered(self) -> list[Skipped]:
        """The notes as load_requests ordered them: by input (a name read twice ranks at its
        last reading) and line, a line that is not UTF-8 first where those tie."""
        rank = {name: n for n, item in enumerate(self.inputs) for name in (item.name, item.source)}
        notes = [k for _, k in self._utf8] + self._bad
        return sorted(notes, key=lambda k: (rank[k.source], k.line))

    def _expand(self, path: str) -> Iterator[Input]:
        """The inputs one command-line path names: stdin, a file, a directory's log files."""
        if path == "-":
            yield self._keep(spool_stdin())
            return
        p = Path(path)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if _is_log_name(f.name) and f.is_file()
                           and (self.own is None or f.resolve() != self.own))
            yield from (Input(str(f), str(f), f) for f in files)
            return
        if not p.exists():
            raise FileError(f"{path}: no such file or directory")
        item = Input(path, str(p), p)
        yield item if p.is_file() else self._keep(spooled(item))  # a pipe is read once

    def _keep(self, item: Input) -> Input:
        self._spools.append(item)
        return item

    def _requests(self, source: str, lines: Lines, note: Note) -> Iterator[LoadedRequest]:
        """The requests of one input: a strict read raises the first bad record's error."""
        kept = note if self.lenient else None
        for line, record in file_records(source, lines, kept):
            try:
                yield _request(source, line, record, self.provider)
            except InputError as exc:
                if kept is None:
                    raise
                kept(Skipped(source, line, str(exc)))


def file_records(source: str, lines: Lines, note: Note | None) -> Iterator[tuple[int, Any]]:
    """(line, record) pairs of one input, as `loader._records` gives them for its whole text:
    JSONL line by line; a file that is one JSON document, whole. Whether it is one is told
    from its first non-blank line alone: a JSON value there followed by more lines is JSONL
    (the whole text fails as "Extra data"), and so is a line that fails within itself; a
    value cut short at the end of that line may go on below (a pretty-printed document), so
    that file is read whole, as `load_requests` reads it."""
    first = next(((n, text) for n, text in lines.numbered() if text.strip()), None)
    if first is None:
        return
    n, text = first
    stripped = text.strip()
    if stripped[0] in "[{":
        skipped: list[Skipped] | None = [] if note is not None else None
        whole = _document_records(source, n, text, lines, skipped)
        if whole is not None:
            if note is not None:
                for item in skipped or []:
                    note(item)
            yield from whole
            return
    else:
        lines.put_back(n, text)
    for n, line in lines.numbered():  # lines end at "\n" only, as in `loader._records`
        if not line.strip():
            continue
        try:
            yield n, _parse(f"{source}:{n}", line)
        except InputError as exc:
            if note is None:
                raise
            note(Skipped(source, n, str(exc)))


def _document_records(source: str, first: int, text: str, lines: Lines,
                      skipped: list[Skipped] | None) -> list[tuple[int, Any]] | None:
    """The records of a file whose first non-blank line, `text` (line `first`), opens one
    JSON document; None when the file is JSONL (the lines taken are put back)."""
    lead = "\n" * (first - 1)  # the blank lines before: only their count matters
    stripped = text.strip()
    try:
        _loads(stripped)
    except json.JSONDecodeError as exc:
        if exc.pos < len(stripped):  # fails within the line: the whole text fails too
            lines.put_back(first, text)
            return None
        return _records(source, lead + text + "\n" + "\n".join(lines), skipped)
    except (RecursionError, ValueError):  # the whole text fails so, at this line
        if skipped is None:
            return _records(source, lead + text, None)  # raises load_requests' error
        lines.put_back(first, text)
        return None
    more = next(((n, line) for n, line in lines.numbered() if line.strip()), None)
    if more is None:
        return _document(source, lead + text, stripped, skipped)
    lines.put_back(*more)
    lines.put_back(first, text)
    return None
