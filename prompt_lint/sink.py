"""Where `prefixgate lint` and `fix` write: a file (gzipped for a name ending in .gz) or stdout.

A write that fails is one `path: cannot write: reason` line on stderr and a False to the
caller (exit 2), never a traceback. `FixedOutput` writes `fix`'s records one at a time as
they are rewritten, byte for byte what writing their joined text at once wrote.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

#: gzip as `gzip.compress(data, mtime=0)` writes it (zlib's own header: no time, no name).
GZIP_LEVEL, GZIP_WBITS = 9, 31


#: Characters gathered from small pieces before one write.
BATCH = 1 << 20


def write_pieces(prog: str, path: str | None, pieces: Iterable[str]) -> bool:
    """Write the text `pieces` make to `path` (stdout for None or "-"; gzipped for a name
    ending in .gz), gathered in writes of about `BATCH` characters; False, after one error
    line on stderr, when it cannot be written."""
    out = TextSink(prog, path)
    if not out.open():
        return False
    batch: list[str] = []
    size = 0
    try:
        for piece in pieces:
            batch.append(piece)
            size += len(piece)
            if size >= BATCH:
                if not out.write("".join(batch)):
                    return False
                batch, size = [], 0
        return out.write("".join(batch)) and out.close()
    finally:
        out.discard()


class TextSink:
    """Text written piece by piece to a file (gzipped for a name ending in .gz) or stdout.
    `via_spool`: the file is also an input still being read, so the text is gathered in a
    temporary file and copied over it at `close`. Each call is False, after one error line
    on stderr, once the output cannot be written (later calls write nothing)."""

    def __init__(self, prog: str, path: str | None, via_spool: bool = False) -> None:
        self.prog, self.path, self.via_spool = prog, path, via_spool
        self.stdout = path is None or path == "-"
        self.packer = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, GZIP_WBITS) \
            if not self.stdout and str(path).endswith(".gz") else None
        self.file: IO[bytes] | None = None
        self.failed = False

    def open(self) -> bool:
        """Open the file (stdout needs no opening)."""
        if self.stdout:
            return True
        try:
            self.file = tempfile.TemporaryFile() if self.via_spool else \
                Path(str(self.path)).open("wb")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            return self._fail(exc)
        return True

    def write(self, text: str) -> bool:
        """Write `text`."""
        if self.failed:
            return False
        if self.stdout:
            return self._stdout(lambda: _stdout().write(text))
        assert self.file is not None
        data = text.encode("utf-8")
        try:
            self.file.write(self.packer.compress(data) if self.packer is not None else data)
        except OSError as exc:
            return self._fail(exc)
        return True

    def close(self) -> bool:
        """Finish the output (the gzip trailer, the copy over an input); False when it
        failed at any point."""
        if self.failed:
            return False
        if self.stdout:
            return self._stdout(lambda: _stdout().flush())
        assert self.file is not None
        try:
            if self.packer is not None:
                self.file.write(self.packer.flush())
            if self.via_spool:
                self.file.seek(0)
                with Path(str(self.path)).open("wb") as target:
                    shutil.copyfileobj(self.file, target)
            self.file.close()
        except OSError as exc:
            return self._fail(exc)
        return True

    def discard(self) -> None:
        """Close the file if an error left it open (what was written to it stays; a spool
        meant to replace an input is dropped, leaving the input as it was)."""
        if self.file is not None and not self.file.closed:
            self.file.close()

    def _fail(self, exc: OSError) -> bool:
        """One error line; the output is given up."""
        self.failed = True
        if self.file is not None:
            self.file.close()
        print(f"{self.prog}: {self.path}: cannot write: {exc.strerror or exc}", file=sys.stderr)
        return False

    def _stdout(self, step: Any) -> bool:
        """A step on stdout; when it fails (a full disk under `> out`, a closed descriptor)
        stdout is pointed at the null device, so that the interpreter's exit does not fail
        flushing it again (exit status 120)."""
        try:
            step()
        except OSError as exc:
            self.failed = True
            print(f"{self.prog}: <stdout>: cannot write: {exc.strerror or exc}",
                  file=sys.stderr)
            sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives to exit
            return False
        return True


def _stdout() -> IO[str]:
    if sys.stdout is None:  # started with its descriptor closed
        raise OSError(errno.EBADF, "stdout is closed")
    return sys.stdout


class FixedOutput:
    """What `fix` writes, record by record: JSONL, or one JSON document when the name ends in
    .json (or .json.gz): the record itself when there is one (`count`), else an array
    indented as `json.dumps(records, indent=2)` indents it."""

    def __init__(self, sink: TextSink, count: int) -> None:
        assert sink.path is not None
        self.sink, self.count, self.written = sink, count, 0
        self.document = sink.path.removesuffix(".gz").endswith(".json")

    def write(self, record: dict[str, Any]) -> bool:
        """Write one record (the `count` records in order make the whole output)."""
        self.written += 1
        if not self.document:
            return self.sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        text = json.dumps(record, ensure_ascii=False, indent=2)
        if self.count == 1:
            return self.sink.write(text + "\n")
        head = "[\n  " if self.written == 1 else ",\n  "
        tail = "\n]\n" if self.written == self.count else ""
        return self.sink.write(head + text.replace("\n", "\n  ") + tail)
