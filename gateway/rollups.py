"""Per-minute, per-hour and per-day rollups of the `requests` table, so /api/stats over days
reads days, hours and minutes, not rows; kept up at read time, so the stats writer pays nothing.

`stats_rollups` holds, per (period, start, tenant, model, replica, backend, family, status),
the additive sums /api/stats is made of (gateway.stats_sums): requests, prompt / cached /
completion tokens, the *paired* predicted and reported cached tokens (an answered request
that has both), the requests with a prediction, prefill time saved and latency. Errors and
client errors / failures follow from `status`. `stats_lint_rollups` counts requests per
(period, start, lint rule id). A period is a minute, an hour or a day (PERIODS, in seconds);
`start` is the epoch second the row's UTC period starts at.

The rollups hold exactly the raw rows with `id <= watermark` (`stats_rollup_state`); readers
add the rows above it from the raw table (few: the ones written since the last catch-up).
`catch_up` moves the watermark forward, a chunk of ids per transaction: one
INSERT ... SELECT ... GROUP BY ... ON CONFLICT DO UPDATE per period, all in SQL (lint ids are
split here, from the chunk's rows grouped per (minute, lint_ids)), and the new watermark, in
the transaction that locks the state row, so two readers catching up at once take turns and
count each row once. It only goes up to ids no transaction can still commit below
(`_safe_top`): SQLite has one writer at a time, so every id under the largest visible one is
final; PostgreSQL hands ids out before commit, so several gateways commit them out of order,
and `_safe_top` waits (SHARE lock on `requests`, at most LOCK_TIMEOUT) for the inserts in
flight. Rows replayed from a spill file get new ids, above the watermark.

`ensure_rollups` (run when the database is opened) starts them empty at watermark 0 when they
were never built or were built with other columns than this version's, then catches up;
`rollups_ready` tells readers whether they may use them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Table, case, delete, func, insert, inspect, literal_column, select, update
from sqlalchemy import text as sql_text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.elements import ColumnElement

from gateway.stats_sums import EPOCH, lint_rules, raw_sums, start_sql
from gateway.stats_tables import Base, LintRollup, RequestRecord, RequestRollup, RollupState

__all__ = ["EPOCH", "PERIODS", "catch_up", "ensure_rollups", "read_snapshot", "rollups_ready",
           "shared_connection", "watermark"]

R = RequestRecord
STATE_NAME = "rollups"
REBUILD_WAIT_S = 300.0  # how long a second process waits for another's reset
CHUNK_IDS = 5000  # ids per catch-up transaction (SQLite: the writer waits for one, ~0.25 s)
LOCK_TIMEOUT_MS = 2000  # PostgreSQL: how long _safe_top waits for inserts in flight
KEY_COLUMNS = ("tenant", "model", "replica", "backend", "family", "status", "nulls")
SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
        "predicted_cached_tokens", "reported_cached_tokens", "predicted_requests",
        "prefill_saved_ms", "latency_ms")
PERIODS = (60, 3600, 86400)  # ascending, each a multiple of the one before
ROLLUP_TABLES: tuple[Table, ...] = tuple(
    Base.metadata.tables[t] for t in (RequestRollup.__tablename__, LintRollup.__tablename__))


def fingerprint() -> str:
    """The rollup columns of this version: a database built with others is rebuilt."""
    return ";".join(f"{t.name}:{','.join(sorted(c.name for c in t.columns))}"
                    for t in ROLLUP_TABLES)


def _keys() -> list[Any]:
    """A raw row's rollup key, in KEY_COLUMNS order (NULL replica / family as '' and a bit of
    `nulls`, see RequestRollup)."""
    def inline(sql: str) -> ColumnElement[Any]:  # PostgreSQL matches GROUP BY text: no $1
        return literal_column(sql)

    nulls = (case((R.replica.is_(None), inline("1")), else_=inline("0"))
             + case((R.family.is_(None), inline("2")), else_=inline("0")))
    return [R.tenant, R.model, func.coalesce(R.replica, inline("''")), R.backend,
            func.coalesce(R.family, inline("''")), R.status, nulls]


def _upsert(dialect: str, table: Table, columns: list[str], rows: Any, sums: tuple[str, ...],
            ) -> Any:
    """INSERT `rows` (a SELECT, or None for an executemany) adding `sums` to a row that has
    the same primary key."""
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = make(table)
    if rows is not None:
        stmt = stmt.from_select(columns, rows)
    keys = [c.name for c in table.primary_key.columns]
    return stmt.on_conflict_do_update(index_elements=keys,
                                      set_={s: table.c[s] + stmt.excluded[s] for s in sums})


def _add_range(conn: Connection, low: int, high: int) -> None:
    """Add the raw rows with low < id <= high to both rollups."""
    in_range = [R.id > low, R.id <= high]
    _add_sums(conn, in_range)
    _add_lints(conn, in_range)


def _add_sums(conn: Connection, where: list[ColumnElement[bool]]) -> None:
    """The rows' sums into `stats_rollups`: one INSERT ... SELECT per period, in SQL."""
    dialect = conn.dialect.name
    sums = {column.name: column.element for column in raw_sums()}
    keys = _keys()
    for period in PERIODS:
        start = start_sql(dialect, R.ts, period)
        grouped = (select(literal_column(str(period)), start, *keys,
                          *(func.coalesce(sums[name], 0) for name in SUMS))
                   .where(*where).group_by(start, *keys))
        conn.execute(_upsert(dialect, ROLLUP_TABLES[0], ["period", "start", *KEY_COLUMNS, *SUMS],
                             grouped, SUMS))


def _add_lints(conn: Connection, where: list[ColumnElement[bool]]) -> None:
    """The rows' lint rule counts into `stats_lint_rollups`: the rows grouped per (minute,
    lint_ids) in SQL, the ids split here as the raw path splits them (`lint_rules`)."""
    dialect = conn.dialect.name
    minute = start_sql(dialect, R.ts, 60)
    lints: dict[tuple[int, int, str], int] = {}
    query = (select(minute.label("minute"), R.lint_ids, func.count().label("n"))
             .where(*where, R.lint_ids != "").group_by(minute, R.lint_ids))
    for row in conn.execute(query):
        for rule in lint_rules(row.lint_ids):
            for period in PERIODS:
                key = (period, int(row.minute) // period * period, rule)
                lints[key] = lints.get(key, 0) + int(row.n)
    if not lints:
        return
    rows = [{"period": p, "start": t, "rule": r, "requests": n}
            for (p, t, r), n in sorted(lints.items())]
    if dialect == "postgresql":
        _pg_add_lints(conn, rows)
    else:
        conn.execute(_upsert(dialect, ROLLUP_TABLES[1], [], None, ("requests",)), rows)


def _pg_add_lints(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """PostgreSQL: the lint upsert as one statement whose rows come in as one array per
    column (`unnest`): pg8000 runs an executemany a round trip per row."""
    table = ROLLUP_TABLES[1]
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    names = list(rows[0])
    arrays = ", ".join(f"CAST(:{n} AS {table.c[n].type.compile(dialect)}[])" for n in names)
    keys = ", ".join(f'"{c.name}"' for c in table.primary_key.columns)
    conn.execute(sql_text(
        f"INSERT INTO {table.name} ({', '.join(names)}) SELECT * FROM unnest({arrays}) "
        f"ON CONFLICT ({keys}) DO UPDATE SET requests = {table.name}.requests "
        "+ EXCLUDED.requests"), {n: [row[n] for row in rows] for n in names})


def _top() -> Any:
    return select(func.coalesce(func.max(R.id), 0))


def _safe_top(engine: Engine) -> int | None:
    """The largest id under which no row can still be committed (None: not known now)."""
    top = _top()
    if engine.dialect.name != "postgresql":
        with engine.connect() as conn:
            return int(conn.scalar(top) or 0)
    try:
        with engine.begin() as conn:  # waits for every insert in flight; new ones wait for it
            conn.execute(sql_text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
            conn.execute(sql_text(f"LOCK TABLE {R.__tablename__} IN SHARE MODE"))
            return int(conn.scalar(top) or 0)
    except DBAPIError:  # a lock timeout: an insert held it longer; catch up next time
        return None


def _claim(conn: Connection) -> int | None:
    """Lock the state row for this transaction (catch-ups and resets take turns: SQLite's
    write lock, PostgreSQL's row lock) and return the watermark; None when not built."""
    S = RollupState
    conn.execute(update(S).where(S.name == STATE_NAME).values(watermark=S.watermark))
    row = conn.execute(select(S.columns, S.watermark).where(S.name == STATE_NAME)).first()
    if row is None or row.columns != fingerprint():
        return None
    return int(row.watermark or 0)


def catch_up(engine: Engine, chunk: int | None = CHUNK_IDS) -> int | None:
    """Add every raw row above the watermark (up to `_safe_top`) to the rollups, `chunk` ids
    per transaction (None: all in one); the watermark reached (None: rollups not built).
    With no row above the watermark it takes no lock and writes nothing (a dashboard
    refreshing an idle gateway)."""
    with engine.connect() as conn:
        mark = watermark(conn)
        if mark is None or mark >= int(conn.scalar(_top()) or 0):
            return mark
    top = _safe_top(engine)
    while True:
        with engine.begin() as conn:
            low = _claim(conn)
            if low is None or top is None or low >= top:
                return low
            high = top if chunk is None else min(top, low + chunk)
            _add_range(conn, low, high)
            conn.execute(update(RollupState).where(RollupState.name == STATE_NAME)
                         .values(watermark=high))


def watermark(conn: Connection) -> int | None:
    """The rollups' watermark as `conn` sees it; None unless built with this version's
    columns."""
    if not inspect(conn).has_table(RollupState.__tablename__):
        return None
    row = conn.execute(select(RollupState.columns, RollupState.watermark)
                       .where(RollupState.name == STATE_NAME)).first()
    if row is None or row.columns != fingerprint():
        return None
    return int(row.watermark or 0)


def rollups_ready(engine: Engine) -> bool:
    """True when this database's rollups were built with this version's columns."""
    with engine.connect() as conn:
        return watermark(conn) is not None


def shared_connection(engine: Engine) -> bool:
    """True for an in-memory SQLite database: one connection, which the writer thread uses
    too (a catch-up there could commit or roll back the writer's batch half-way; its rows
    above the watermark are read raw instead)."""
    return isinstance(engine.pool, StaticPool)


@contextmanager
def read_snapshot(engine: Engine) -> Iterator[Connection]:
    """A connection whose reads all see one state of the database: the watermark, the
    rollups and the raw rows above it agree (a catch-up committed between two reads would
    otherwise count its rows twice or not at all)."""
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            yield conn
            conn.rollback()
        return
    with engine.connect() as conn:
        # pysqlite opens no transaction for a SELECT: BEGIN makes the first read start one
        if not shared_connection(engine):
            conn.exec_driver_sql("BEGIN")
        try:
            yield conn
        finally:
            conn.rollback()


def ensure_rollups(engine: Engine, wait_s: float = REBUILD_WAIT_S) -> None:
    """Start the rollups empty at watermark 0 unless built with this version's columns (a
    second process doing the same waits on the lock and finds them started), then catch up
    with the raw rows in one transaction (before this process writes: building them for a
    database an older gateway wrote is then one sorted insert per period, not chunks of
    upserts scattered over the table, 1M rows: 162 s in chunks)."""
    deadline = time.monotonic() + wait_s
    while not rollups_ready(engine):
        try:
            with engine.begin() as conn:
                if _claim(conn) is None:
                    _reset(conn)
            break
        except (OperationalError, InterfaceError, IntegrityError):  # locked, or a race
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
    catch_up(engine, chunk=None)


def _reset(conn: Connection) -> None:
    conn.execute(delete(RequestRollup))
    conn.execute(delete(LintRollup))
    conn.execute(delete(RollupState).where(RollupState.name == STATE_NAME))
    conn.execute(insert(RollupState), [{"name": STATE_NAME, "columns": fingerprint(),
                                        "watermark": 0}])

