"""One RequestRecord per request, stored through SQLAlchemy 2.x by a batched background writer.

`RecordStore(url)` takes any SQLAlchemy URL (SQLite file by default; PostgreSQL for several
gateway replicas writing one table). `add()` normalises the record (see gateway.record_rows) and
only enqueues: a writer thread commits batches off the request path. `flush()` waits until
everything added so far is committed or spilled; `close()` drains the queue before returning.

Durability: a batch the database refuses while it still answers is retried row by row, so one
bad row never takes others with it. While the database is down or refuses every write (a
read-only file, a full disk: an OperationalError, or a failed probe write), or when the
bounded in-memory queue is full, rows go to an append-only local spill file (gateway.spill)
and are replayed in order when the database answers again. `lost` counts rows dropped after
all that (a row the database refuses on its own); `pending()` counts rows queued or spilled;
`degraded` is True while the last database operation failed.

Rollups: the writer inserts raw rows only. /api/stats keeps per-minute, per-hour and per-day
rollups of them up to date when it reads (gateway.rollups), so the writer thread does no more
work per row than it would without them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, func, insert, inspect, select
from sqlalchemy import text as sql_text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from gateway.record_rows import column_rules, normalise_row, to_json_row
from gateway.rollups import ensure_rollups
from gateway.spill import SpillFile
from gateway.stats_tables import Base, RequestRecord, utcnow

__all__ = ["RecordStore", "RequestRecord", "StatsDatabaseError", "open_database"]

log = logging.getLogger("prefixgate.stats")
REPLAY_BATCH = 2048
REPLAY_PAUSE_S = 0.5
DEFAULT_MAX_QUEUE = 10_000


RECORD_COLUMNS = frozenset(c.name for c in RequestRecord.__table__.columns) - {"id"}
_INSERT = insert(RequestRecord)


_DEFAULTS = {c.name: c.default.arg if c.default is not None and c.default.is_scalar else None
             for c in RequestRecord.__table__.columns if c.name in RECORD_COLUMNS}
_RULES = column_rules(RequestRecord.__table__)  # type: ignore[arg-type]


def _row(record: RequestRecord | Mapping[str, Any]) -> dict[str, Any]:
    """A full, normalised row for the executemany insert: every row has the same keys, missing
    ones take the column's default (`ts`: now)."""
    if isinstance(record, RequestRecord):
        record = {name: getattr(record, name) for name in RECORD_COLUMNS}
    row = {**_DEFAULTS, **{k: v for k, v in record.items() if v is not None}}
    if row["ts"] is None:
        row["ts"] = utcnow()
    return normalise_row(row, _RULES)


def _probe_row() -> dict[str, Any]:
    """A row every database that takes writes accepts (inserted and rolled back)."""
    return _row({"request_id": "write-probe", "tenant": "", "model": "", "backend": "",
                 "provider": "", "route": "", "status": 0})


def default_spill_path(url: str) -> Path:
    """Where rows wait during an outage: beside an SQLite file, else in the working folder."""
    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() == "sqlite" and database and database != ":memory:":
        return Path(database).expanduser().with_name(Path(database).name + ".spill.jsonl")
    return Path("prefixgate-stats.spill.jsonl")


class StatsDatabaseError(RuntimeError):
    """The stats database cannot be opened at start-up (the message names it, no password)."""


def open_database(url: str) -> Engine:
    """`make_engine(url)` with its tables created (or their missing columns added) and the
    rollups built from the raw rows if they are not (gateway.rollups); a StatsDatabaseError
    saying which database and why when that fails."""
    try:
        engine = make_engine(url)
        Base.metadata.create_all(engine)
        add_missing_columns(engine)
        _build_rollups(engine)
    except (OSError, SQLAlchemyError) as exc:
        shown = make_url(url).render_as_string(hide_password=True) if "://" in url else url
        reason = exc.orig if isinstance(exc, DBAPIError) else exc
        raise StatsDatabaseError(f"stats database {shown}: {reason}") from exc
    return engine


def _build_rollups(engine: Engine) -> None:
    """`ensure_rollups`, on PostgreSQL over connections without the writer's socket timeout
    (building the rollups of a large table takes longer than one batch insert may)."""
    if engine.dialect.name == "sqlite":
        ensure_rollups(engine)
        return
    patient = create_engine(engine.url)
    try:
        ensure_rollups(patient)
    finally:
        patient.dispose()


def make_engine(url: str) -> Engine:
    """An SQLAlchemy engine; SQLite files get their folder created and WAL journaling."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # a frozen server must not hang the writer forever: pg8000 takes a socket timeout
        args = {"timeout": 10} if parsed.get_driver_name() == "pg8000" else {}
        return create_engine(url, pool_pre_ping=True, connect_args=args)
    database = parsed.database
    if not database or database == ":memory:":
        # one shared connection, or every connection would open its own empty database
        return create_engine(url, connect_args={"check_same_thread": False},
                             poolclass=StaticPool)
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def add_missing_columns(engine: Engine) -> None:
    """Add columns this version's tables have and an older database lacks (nullable adds
    only: a database written by an older gateway keeps working; rollups built without a
    column are rebuilt by gateway.rollups.ensure_rollups)."""
    inspector = inspect(engine)
    with engine.begin() as conn:
        for table in Base.metadata.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name not in have:
                    kind = column.type.compile(engine.dialect)
                    ddl = f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'
                    conn.execute(sql_text(ddl))


def _sqlite_pragmas(dbapi_conn: object, _record: object) -> None:
    cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


class _Flush:
    """A marker in the queue: set when every record queued before it is committed."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class RecordStore:
    """Batched, thread-backed writer of RequestRecords; readers use `session()` or `engine`."""

    def __init__(
        self, url: str, *, batch_size: int = 256, flush_interval_s: float = 0.25,
        max_queue: int = DEFAULT_MAX_QUEUE, spill_path: str | Path | None = None,
    ) -> None:
        if batch_size <= 0 or flush_interval_s <= 0 or max_queue <= 0:
            raise ValueError("batch_size, flush_interval_s and max_queue must be positive")
        self.url = url
        self.engine = open_database(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._batch_size = batch_size
        self._interval = flush_interval_s
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._wake = threading.Event()  # set: the writer should not wait out its interval
        self.spill = SpillFile(spill_path or default_spill_path(url))
        self._closed = False
        self._next_replay = 0.0
        self.written = 0
        self.lost = 0
        self.spilled = 0
        self.degraded = False
        self._thread = threading.Thread(target=self._run, name="prefixgate-stats", daemon=True)
        self._thread.start()

    def add(self, record: RequestRecord | Mapping[str, Any]) -> None:
        """Queue one record; never blocks on the database. A record may be a `RequestRecord`
        or a plain mapping of its column values (the request path's cheap form). Its fields
        are normalised here; when the queue is full the row goes straight to the spill file."""
        if not isinstance(record, RequestRecord):
            unknown = record.keys() - RECORD_COLUMNS
            if unknown:
                raise ValueError(f"not RequestRecord columns: {sorted(unknown)}")
        row = _row(record)
        if self._closed:
            self._write([row])
            return
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self._spill([row])
            return
        if self._queue.qsize() >= self._batch_size:
            self._wake.set()

    def pending(self) -> int:
        """Rows not yet in the database: queued in memory or waiting in the spill file."""
        return self._queue.qsize() + self.spill.count

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every record added so far is committed (or spilled to disk while the
        database is down). False on timeout."""
        if self._closed:
            return True
        marker = _Flush()
        self._queue.put(marker)
        self._wake.set()
        return marker.done.wait(timeout)

    def close(self) -> None:
        """Drain and commit everything queued, stop the writer, release connections."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._wake.set()
        self._thread.join()
        self.spill.close()
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A read session for stats queries."""
        with self._sessions() as session:
            yield session

    def count(self) -> int:
        """Number of stored records (flush first to include queued ones)."""
        with self.session() as session:
            return int(session.scalar(select(func.count(RequestRecord.id))) or 0)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch, markers, stop = self._collect()
            if batch:
                self._write(batch)
            if self.spill.count and (markers or stop or time.monotonic() >= self._next_replay):
                self._replay()
            for marker in markers:
                marker.done.set()

    def _collect(self) -> tuple[list[dict[str, Any]], list[_Flush], bool]:
        """One batch: sleep until woken (a full batch, a flush, stop) or one flush interval
        has passed, then take what is queued. Records are not waited for one by one: a
        request never wakes the writer thread (a wake-up per record costs the request path
        a thread switch), so at low rates records are written in batches too."""
        batch: list[dict[str, Any]] = []
        markers: list[_Flush] = []
        if self._queue.empty():
            self._wake.wait(self._interval)
        self._wake.clear()
        while len(batch) < self._batch_size:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                return batch, markers, True
            if isinstance(item, _Flush):
                markers.append(item)
                break
            batch.append(item)  # type: ignore[arg-type]
        return batch, markers, False

    def _insert(self, rows: list[dict[str, Any]]) -> None:
        with self._sessions() as session, session.begin():
            session.execute(_INSERT, rows)

    def database_up(self) -> bool:
        """True when the database takes a write now: a known-good row inserted and rolled
        back. A database that answers reads but refuses every write (a read-only file or
        mount, a full disk, a lock held past the busy timeout) is down for the writer: its
        rows are spilled and replayed, not dropped as if each were refused on its own."""
        try:
            with self.engine.connect() as conn:
                transaction = conn.begin()
                try:
                    conn.execute(_INSERT, [_probe_row()])
                finally:
                    transaction.rollback()
            return True
        except Exception:  # noqa: BLE001 - any failure means "not writable now"
            # reconnect next time: an SQLite connection opened on a read-only file stays
            # read-only after the file is made writable again
            self.engine.dispose()
            return False

    def _database_refused(self, exc: BaseException) -> bool:
        """True when the database, not a row, failed the insert: an OperationalError (the
        DB-API's class for I/O errors, locks, a read-only or full database; SQLite may raise
        it only at commit, where a rolled-back probe cannot see it), or a database that
        refuses the probe write. A row refused otherwise is that row's own fault."""
        orig = exc.orig if isinstance(exc, DBAPIError) else exc
        if type(orig).__name__ == "OperationalError":
            self.engine.dispose()  # reconnect: a connection can stay read-only
            return True
        return not self.database_up()

    def _write(self, rows: list[dict[str, Any]]) -> None:
        """Commit `rows`; a refused batch is retried row by row while the database answers,
        and spilled to disk while it does not (rows behind a spill are spilled too, in order)."""
        if self.spill.count:  # keep order: older spilled rows go in first
            self._spill(rows)
            return
        try:
            self._insert(rows)
        except Exception as exc:  # noqa: BLE001 - a database failure must not kill the writer
            if self._database_refused(exc):
                self._enter_outage(rows)
                return
            self._write_one_by_one(rows)
            return
        self.written += len(rows)
        self.degraded = False

    def _write_one_by_one(self, rows: list[dict[str, Any]]) -> None:
        for i, row in enumerate(rows):
            try:
                self._insert([row])
                self.written += 1
            except Exception as exc:  # noqa: BLE001
                if self._database_refused(exc):
                    self._enter_outage(rows[i:])
                    return
                self.lost += 1
                log.error("stats row %s refused by the database, dropped: %s",
                          row.get("request_id"), type(exc).__name__)

    def _enter_outage(self, rows: list[dict[str, Any]]) -> None:
        if not self.degraded:
            log.error("stats database unreachable or refusing writes; spilling records to %s",
                      self.spill.path)
        self.degraded = True
        self._spill(rows)

    def _spill(self, rows: list[dict[str, Any]]) -> None:
        try:
            self.spilled += self.spill.append(to_json_row(r) for r in rows)
        except OSError:
            self.lost += len(rows)
            log.exception("could not spill %d stats records; they are lost", len(rows))

    def _replay(self) -> None:
        """Move spilled rows into the database, oldest first, while it answers."""
        while self.spill.count:
            with self.spill.exclusive():  # one replayer of a batch, whichever process
                batch = self.spill.read(REPLAY_BATCH)
                rows = [normalise_row(r, _RULES) for r in batch.rows]
                try:
                    if rows:
                        self._insert(rows)
                except Exception as exc:  # noqa: BLE001
                    if self._database_refused(exc):
                        self.degraded = True
                        self._next_replay = time.monotonic() + REPLAY_PAUSE_S
                        return
                    self._write_one_by_one(rows)
                else:
                    self.written += len(rows)
                self.spill.drop_first(batch.lines)
            self.degraded = False
