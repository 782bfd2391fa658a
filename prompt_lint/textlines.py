"""An input's lines, read from disk one at a time: what `stream.LogSource` reads twice.

A gzip stream (told by its first bytes, as `loader` tells it) is decompressed as it is read;
lines end at "\\n" only (U+2028, U+2029 and U+0085 may stand raw in a JSON string); a line
that is not UTF-8 is refused, or for a lenient read noted and read as "" so that every other
line keeps its number; the byte order mark is dropped from the first line. The messages are
`loader`'s, word for word.
"""

from __future__ import annotations

import gzip
import re
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, NamedTuple, cast

from prompt_lint.loader import BOM, GZIP_MAGIC, InputError, Skipped

#: gzip's reader names both checksums of a CRC mismatch; `gzip.decompress` (loader's) did not.
_CRC = re.compile(r"^CRC check failed .*$")
#: Bytes copied from stdin at a time.
CHUNK = 1 << 20


class FileError(InputError):
    """An input that cannot be read as text (missing, unreadable, a cut gzip stream, or
    strictly a line not UTF-8): `load_requests` finds these before any bad record."""


class Input(NamedTuple):
    """One input: `source`, its name in records and reports; `name`, in messages about its
    bytes (loader's `str(Path)`); its bytes are at `path`, in `spool` (a copy of stdin or of
    a pipe) or are the `text` of a text stdin; `limit`: the bytes a first reading read."""

    source: str
    name: str
    path: Path | None = None
    spool: IO[bytes] | None = None
    text: str | None = None
    limit: int | None = None


def spool_stdin() -> Input:
    """stdin as an input: copied to a temporary file (a text stdin is kept as its text); a
    FileError when it cannot be read (closed, `<&-`)."""
    if sys.stdin is None:
        raise FileError("<stdin>: cannot read: stdin is closed")
    stdin = getattr(sys.stdin, "buffer", None)  # None where stdin was replaced by text
    if stdin is None:
        try:
            text = sys.stdin.read()
        except OSError as exc:
            raise FileError(f"<stdin>: cannot read: {exc.strerror or exc}") from None
        return Input("<stdin>", "<stdin>", text=text.removeprefix(BOM))
    return Input("<stdin>", "<stdin>", spool=_copy("<stdin>", stdin))


def spooled(item: Input) -> Input:
    """A file that cannot be read twice (a pipe, `<(zcat log.gz)`) copied to a temporary
    file."""
    assert item.path is not None
    try:
        with item.path.open("rb") as stream:
            return item._replace(spool=_copy(item.name, stream))
    except OSError as exc:
        raise FileError(f"{item.name}: cannot read: {exc.strerror or exc}") from None


def _copy(name: str, stream: IO[bytes]) -> IO[bytes]:
    spool = tempfile.TemporaryFile()  # noqa: SIM115 - the caller closes it
    try:
        while True:
            try:
                chunk = stream.read(CHUNK)
            except OSError as exc:
                raise FileError(f"{name}: cannot read: {exc.strerror or exc}") from None
            if not chunk:
                return spool
            spool.write(chunk)
    except OSError as exc:
        spool.close()
        raise FileError(f"{name}: cannot copy to a temporary file: "
                        f"{exc.strerror or exc}") from None
    except FileError:
        spool.close()
        raise


class Lines:
    """An input's lines as text, numbered from 1 (see the module docstring); `note`: where a
    lenient read notes a line that is not UTF-8 (None: a strict read raises a FileError).
    `read`: the bytes read so far, the limit of a second reading. Lines taken may be put
    back, to be taken again."""

    def __init__(self, item: Input, note: Callable[[Skipped], None] | None) -> None:
        self.item, self.note = item, note
        self.read = 0
        self.line = 0
        self._back: list[tuple[int, str]] = []
        self._raw = _raw_lines(item)

    def __iter__(self) -> Iterator[str]:
        return (text for _, text in self.numbered())

    def numbered(self) -> Iterator[tuple[int, str]]:
        """(line number, text) pairs from here on."""
        while True:
            if self._back:
                yield self._back.pop()
                continue
            data = next(self._raw, None)
            if data is None:
                return
            yield self._decode(data)

    def put_back(self, line: int, text: str) -> None:
        """Give a line taken back: the next one taken (put back last, taken first)."""
        self._back.append((line, text))

    def drain(self) -> None:
        """Read the rest (a strict read checks that it is all UTF-8)."""
        self._back.clear()
        for _ in self.numbered():
            pass

    def _decode(self, data: bytes | str) -> tuple[int, str]:
        self.read += len(data)
        self.line += 1
        if isinstance(data, str):
            return self.line, data
        data = data.removesuffix(b"\n")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            column = len(data[:exc.start].decode("utf-8", "replace")) + 1
            problem = (f"{self.item.name}:{self.line}: not UTF-8: byte "
                       f"0x{data[exc.start]:02x} (column {column})")
            if self.note is None:
                raise FileError(problem) from None
            self.note(Skipped(self.item.name, self.line, problem))
            text = ""
        return self.line, text.removeprefix(BOM) if self.line == 1 else text


def _raw_lines(item: Input) -> Iterator[bytes | str]:
    """The input's lines (bytes, each with its "\\n"; the text of a text stdin split at
    "\\n"), up to `item.limit` bytes."""
    if item.text is not None:
        yield from item.text.split("\n")
        return
    if item.spool is not None:
        item.spool.seek(0)
        yield from _limited(item, item.spool)
        return
    assert item.path is not None
    try:
        stream = item.path.open("rb")
    except OSError as exc:
        raise FileError(f"{item.name}: cannot read: {exc.strerror or exc}") from None
    with stream:
        yield from _limited(item, stream)


def _limited(item: Input, stream: IO[bytes]) -> Iterator[bytes]:
    """`stream`'s lines, gunzipped when it is a gzip stream, up to `item.limit` bytes."""
    try:
        packed = stream.read(len(GZIP_MAGIC)) == GZIP_MAGIC
        stream.seek(0)
    except OSError as exc:
        raise FileError(f"{item.name}: cannot read: {exc.strerror or exc}") from None
    reader = cast(IO[bytes], gzip.GzipFile(fileobj=stream, mode="rb")) if packed else stream
    left = item.limit
    lines = iter(reader)
    while left is None or left > 0:
        try:
            line = next(lines, b"")
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            reason = "CRC check failed" if _CRC.match(str(exc)) else str(exc)
            raise FileError(f"{item.name}: cannot read: not a whole gzip stream "
                            f"({reason})") from None
        except OSError as exc:
            raise FileError(f"{item.name}: cannot read: {exc.strerror or exc}") from None
        if not line:
            return
        if left is not None:
            line = line[:left]
            left -= len(line)
        yield line
