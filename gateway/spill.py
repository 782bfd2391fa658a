"""An append-only local file of stats rows that could not reach the database.

While the database is down the writer appends each batch here (one JSON object per line,
fsync'd), so a record survives both the outage and a gateway restart. When the database answers
again the writer replays the file in order and truncates it. In one process the stats writer
thread and, when the in-memory queue is full, `RecordStore.add` touch the file; across processes
(gateway workers on one SQLite file spill beside it, into one file) an exclusive `flock` on the
file's folder orders them (the file itself is replaced when rows are dropped, so it cannot
carry the lock), and `exclusive()` holds it across a whole replay batch, so two processes
never replay the same rows.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple


class SpillBatch(NamedTuple):
    """Rows read from the start of the file and how many lines they took (torn lines too)."""

    rows: list[dict[str, Any]]
    lines: int


class SpillFile:
    """JSON-lines rows on local disk: `append`, `read`, `drop_first` and a row count."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._held = 0  # nesting depth of `exclusive` in this process
        self._lock_fd: int | None = None  # the folder, opened on first use to be locked
        self._count = self._count_lines()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the file against this process's other threads and against other processes
        that share it (reentrant: the methods below take it too)."""
        with self._lock:
            if self._held == 0:
                fcntl.flock(self._lock_file(), fcntl.LOCK_EX)
            self._held += 1
            try:
                yield
            finally:
                self._held -= 1
                if self._held == 0:
                    fcntl.flock(self._lock_file(), fcntl.LOCK_UN)

    def _lock_file(self) -> int:
        if self._lock_fd is None:
            folder = self.path.absolute().parent
            folder.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(folder, os.O_RDONLY)
        return self._lock_fd

    def close(self) -> None:
        """Release the folder opened for the lock (opened again if the file is used after)."""
        with self._lock:
            if self._lock_fd is not None and self._held == 0:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _count_lines(self) -> int:
        if not self.path.exists():
            return 0
        with self.path.open("rb") as fh:
            return sum(1 for line in fh if line.strip())

    @property
    def count(self) -> int:
        """Rows waiting in the file."""
        return self._count

    def append(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Append rows durably; returns how many were written."""
        lines = [json.dumps(dict(row), ensure_ascii=True) + "\n" for row in rows]
        if not lines:
            return 0
        with self.exclusive():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="ascii") as fh:
                fh.writelines(lines)
                fh.flush()
                os.fsync(fh.fileno())
            self._count += len(lines)
        return len(lines)

    def read(self, limit: int) -> SpillBatch:
        """Up to `limit` lines from the start of the file as rows (a torn line is skipped)."""
        rows: list[dict[str, Any]] = []
        lines = 0
        with self.exclusive():
            if not self.path.exists():
                return SpillBatch(rows, 0)
            with self.path.open("r", encoding="ascii") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    if lines >= limit:
                        break
                    lines += 1
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        continue
        return SpillBatch(rows, lines)

    def drop_first(self, n: int) -> None:
        """Remove the first `n` rows (after they were committed), atomically."""
        with self.exclusive():
            if not self.path.exists():
                self._count = 0
                return
            with self.path.open("r", encoding="ascii") as fh:
                rest = [line for line in fh if line.strip()][n:]
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            with tmp.open("w", encoding="ascii") as fh:
                fh.writelines(rest)
                fh.flush()
                os.fsync(fh.fileno())
            if rest:
                os.replace(tmp, self.path)
            else:
                tmp.unlink()
                self.path.unlink()
            self._count = len(rest)
