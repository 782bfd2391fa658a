"""One RequestRecord per request, stored through SQLAlchemy 2.x by a batched background writer.

`RecordStore(url)` takes any SQLAlchemy URL (SQLite file by default; PostgreSQL for several
gateway replicas writing one table). `add()` only enqueues: a writer thread commits batches off
the request path. `flush()` waits until everything added so far is committed; `close()` drains
the queue before returning, so a clean shutdown never loses a record.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    Integer,
    String,
    Text,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
)
from sqlalchemy import text as sql_text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool

log = logging.getLogger("prefixgate.stats")
MAX_WRITE_ATTEMPTS = 5


class Base(DeclarativeBase):
    """Declarative base of the gateway's tables."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


class RequestRecord(Base):
    """What the gateway remembers about one request (no prompt text unless --store-prompts)."""

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_utcnow, index=True)
    request_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    model: Mapped[str] = mapped_column(String(256))
    backend: Mapped[str] = mapped_column(String(32))
    replica: Mapped[str | None] = mapped_column(String(512), nullable=True)
    provider: Mapped[str] = mapped_column(String(16))
    route: Mapped[str] = mapped_column(String(64))
    status: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    predicted_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    reported_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    tpot_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    prefill_saved_ms: Mapped[float] = mapped_column(Float, default=0.0)
    # token counts are the gateway's estimate: the upstream sent no usage
    usage_estimated: Mapped[bool] = mapped_column(Boolean, default=False)
    lint_ids: Mapped[str] = mapped_column(String(512), default="")
    family: Mapped[str | None] = mapped_column(String(128), nullable=True)
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt_text: Mapped[str | None] = mapped_column(Text, nullable=True)


RECORD_COLUMNS = frozenset(c.name for c in RequestRecord.__table__.columns) - {"id"}
_INSERT = insert(RequestRecord)


_DEFAULTS = {c.name: c.default.arg if c.default is not None and c.default.is_scalar else None
             for c in RequestRecord.__table__.columns if c.name in RECORD_COLUMNS}


def _row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A full row for the executemany insert: every row has the same keys, missing ones take
    the column's default (`ts`: now)."""
    row = {**_DEFAULTS, **record}
    if row["ts"] is None:
        row["ts"] = _utcnow()
    return row


def make_engine(url: str) -> Engine:
    """An SQLAlchemy engine; SQLite files get their folder created and WAL journaling."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
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
    """Add columns this version's RequestRecord has and an older database lacks (nullable
    adds only: a database written by an older gateway keeps working)."""
    table = Base.metadata.tables[RequestRecord.__tablename__]
    have = {c["name"] for c in inspect(engine).get_columns(table.name)}
    with engine.begin() as conn:
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
        self, url: str, *, batch_size: int = 256, flush_interval_s: float = 0.25
    ) -> None:
        if batch_size <= 0 or flush_interval_s <= 0:
            raise ValueError("batch_size and flush_interval_s must be positive")
        self.url = url
        self.engine = make_engine(url)
        Base.metadata.create_all(self.engine)
        add_missing_columns(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._batch_size = batch_size
        self._interval = flush_interval_s
        self._queue: queue.Queue[object] = queue.Queue()
        self._closed = False
        self.written = 0
        self.lost = 0
        self._thread = threading.Thread(target=self._run, name="prefixgate-stats", daemon=True)
        self._thread.start()

    def add(self, record: RequestRecord | Mapping[str, Any]) -> None:
        """Queue one record; never blocks on the database. A record may be a `RequestRecord`
        or a plain mapping of its column values (the request path's cheap form: the writer
        thread inserts those with one executemany, no ORM objects)."""
        if not isinstance(record, RequestRecord):
            unknown = record.keys() - RECORD_COLUMNS
            if unknown:
                raise ValueError(f"not RequestRecord columns: {sorted(unknown)}")
        if self._closed:
            self._write([record])
            return
        self._queue.put(record)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every record added so far is committed. False on timeout."""
        if self._closed:
            return True
        marker = _Flush()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def close(self) -> None:
        """Drain and commit everything queued, stop the writer, release connections."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()
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
            for marker in markers:
                marker.done.set()

    def _collect(self) -> tuple[list[RequestRecord | Mapping[str, Any]], list[_Flush], bool]:
        """One batch: wait for a first item, then keep collecting for up to one flush
        interval (a flush marker, a full batch or stop ends it early), so that at low request
        rates records are still written in batches rather than one transaction each (a
        per-record ORM commit costs the request path milliseconds of GIL time)."""
        batch: list[RequestRecord | Mapping[str, Any]] = []
        markers: list[_Flush] = []
        try:
            item = self._queue.get(timeout=self._interval)
        except queue.Empty:
            return batch, markers, False
        deadline = time.monotonic() + self._interval
        while True:
            if item is _STOP:
                return batch, markers, True
            if isinstance(item, _Flush):
                markers.append(item)
                return batch, markers, False
            batch.append(item)  # type: ignore[arg-type]
            if len(batch) >= self._batch_size:
                return batch, markers, False
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                return batch, markers, False

    def _write(self, batch: list[RequestRecord | Mapping[str, Any]]) -> None:
        objects = [r for r in batch if isinstance(r, RequestRecord)]
        rows = [_row(r) for r in batch if not isinstance(r, RequestRecord)]
        for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
            try:
                with self._sessions() as session, session.begin():
                    if rows:
                        session.execute(_INSERT, rows)
                    if objects:
                        session.add_all(objects)
                self.written += len(batch)
                return
            except Exception:  # noqa: BLE001 - a database hiccup must not kill the writer
                log.exception("stats write failed (attempt %d/%d)", attempt, MAX_WRITE_ATTEMPTS)
                threading.Event().wait(min(0.05 * 2**attempt, 1.0))
        self.lost += len(batch)
        log.error("dropped %d stats records after %d attempts", len(batch), MAX_WRITE_ATTEMPTS)
