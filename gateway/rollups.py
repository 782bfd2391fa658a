"""Per-minute, per-hour and per-day rollups of the `requests` table, so /api/stats over days
reads days, hours and minutes, not rows.

`request_rollups` holds, per (period, start, tenant, model, replica, backend, family, status),
the additive sums /api/stats is made of (gateway.stats_sums): requests, prompt / cached /
completion tokens, the *paired* predicted and reported cached tokens (an answered request
that has both), the requests with a prediction, prefill time saved and latency. Errors and
client errors / failures follow from `status`. `lint_rollups` counts requests per (period,
start, lint rule id). A period is a minute, an hour or a day (PERIODS, in seconds); `start` is
the epoch second the row's UTC period starts at. Every raw row is in one row of each period.

The stats writer adds each batch to both tables in the transaction that inserts its raw rows
(grouped here, then one upsert per table), and so does every other write path (one row at a
time, spill replay): the rollups always equal the raw rows. A key's columns may be NULL
(replica, family), and NULLs never conflict in a unique index, so a row's identity is
`group_key`, a digest of its key columns in which NULL and '' differ.

`ensure_rollups` (run when the database is opened) rebuilds both tables from the raw rows when
they were never built (a database written by an older gateway) or were built with other
columns than this version's (a column added later); `rollups_ready` tells readers whether
they may use them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    Table,
    Text,
    case,
    cast,
    delete,
    func,
    insert,
    inspect,
    literal_column,
    select,
)
from sqlalchemy import text as sql_text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from gateway.stats_sums import lint_rules, raw_sums, start_sql
from gateway.stats_tables import Base, LintRollup, RequestRecord, RequestRollup, RollupState

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
STATE_NAME = "rollups"
REBUILD_WAIT_S = 300.0  # how long a second process waits for another's rebuild
KEY_COLUMNS = ("tenant", "model", "replica", "backend", "family", "status")
INT_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens",
            "predicted_cached_tokens", "reported_cached_tokens", "predicted_requests")
FLOAT_SUMS = ("prefill_saved_ms", "latency_ms")
SUMS = INT_SUMS + FLOAT_SUMS
PERIODS = (60, 3600, 86400)  # ascending, each a multiple of the one before


ROLLUP_TABLES: tuple[Table, ...] = tuple(
    Base.metadata.tables[t] for t in (RequestRollup.__tablename__, LintRollup.__tablename__))


def fingerprint() -> str:
    """The rollup columns of this version: a database built with others is rebuilt."""
    return ";".join(f"{t.name}:{','.join(sorted(c.name for c in t.columns))}"
                    for t in ROLLUP_TABLES)


def start_of(ts: datetime, period: int) -> int:
    """The epoch second the UTC period (PERIODS) holding `ts` starts at (a naive `ts` is UTC,
    as SQLite stores it)."""
    aware = ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    return (aware - EPOCH) // timedelta(seconds=period) * period


def group_key(key: Iterable[Any]) -> str:
    """The digest naming one rollup group: MD5 of its key columns, each `-` when NULL or its
    length, `:` and its text, joined by `|` (so NULL and '' differ, and PostgreSQL computes the
    same with md5() when rebuilding, see `_group_key_sql`)."""
    text = "|".join("-" if v is None else f"{len(str(v))}:{v}" for v in key)
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


def _group_key_sql(conn: Connection) -> ColumnElement[Any]:
    """`group_key` of a `requests` row's key columns, in SQL (SQLite: `group_key` itself,
    registered on the connection)."""
    columns = [getattr(RequestRecord, name) for name in KEY_COLUMNS]
    if conn.dialect.name == "sqlite":
        raw = conn.connection.dbapi_connection
        raw.create_function("prefixgate_group_key", len(columns),  # type: ignore[union-attr]
                            lambda *key: group_key(key), deterministic=True)
        return func.prefixgate_group_key(*columns)
    joined: ColumnElement[Any] | None = None
    for column in columns:
        value = cast(column, Text)
        part = case((column.is_(None), literal_column("'-'", Text)),
                    else_=cast(func.length(value), Text).concat(literal_column("':'", Text))
                    .concat(value))
        joined = part if joined is None else joined.concat(literal_column("'|'", Text)).concat(part)
    return func.md5(joined)


def _row_sums(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """One raw row's contribution, in INT_SUMS order (see gateway.stats_sums.paired)."""
    predicted, reported = row.get("predicted_cached_tokens"), row.get("reported_cached_tokens")
    paired = row["status"] < 400 and predicted is not None and reported is not None
    return (1, row["prompt_tokens"] or 0, row["cached_tokens"] or 0,
            row["completion_tokens"] or 0, predicted if paired else 0,
            reported if paired else 0, int(predicted is not None))


def group_rows(rows: Iterable[Mapping[str, Any]],
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Normalised raw rows as rollup rows of every period: (request_rollups rows, lint_rollups
    rows), each key once, in key order (concurrent upserts take row locks in one order)."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    lints: dict[tuple[int, int, str], int] = {}
    for row in rows:
        key = tuple(row[name] for name in KEY_COLUMNS)
        sums = _row_sums(row)
        rules = lint_rules(row.get("lint_ids"))
        for period in PERIODS:
            start = start_of(row["ts"], period)
            acc = groups.get((period, start, *key))
            if acc is None:
                acc = groups[(period, start, *key)] = [0] * len(INT_SUMS) + [0.0, 0.0]
            for i, value in enumerate(sums):
                acc[i] += value
            acc[-2] += row["prefill_saved_ms"] or 0.0
            acc[-1] += row["latency_ms"] or 0.0
            for rule in rules:
                lints[(period, start, rule)] = lints.get((period, start, rule), 0) + 1
    out = []
    for (period, start, *columns), acc in groups.items():
        out.append({"period": period, "start": start, "group_key": group_key(columns),
                    **dict(zip(KEY_COLUMNS, columns, strict=True)),
                    **dict(zip(SUMS, acc, strict=True))})
    out.sort(key=lambda r: (r["period"], r["start"], r["group_key"]))
    lint_rows = [{"period": p, "start": t, "rule": rule, "requests": n}
                 for (p, t, rule), n in sorted(lints.items())]
    return out, lint_rows


def _upsert(dialect: str, table: Table, index: list[str], sums: Iterable[str]) -> Any:
    """SQLite: one INSERT ... ON CONFLICT DO UPDATE, executed per row (no round trips)."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(table)
    added = {name: func.coalesce(table.c[name], 0) + stmt.excluded[name] for name in sums}
    return stmt.on_conflict_do_update(index_elements=index, set_=added)


def _pg_upsert(db: Session | Connection, table: Table, index: list[str], sums: Iterable[str],
               rows: list[dict[str, Any]]) -> None:
    """PostgreSQL: the same upsert as one statement whose rows come in as one array per
    column (`unnest`): pg8000 runs an executemany row by row, a round trip each."""
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    names = list(rows[0])
    arrays = ", ".join(f"CAST(:{n} AS {table.c[n].type.compile(dialect)}[])" for n in names)
    added = ", ".join(f'"{n}" = COALESCE({table.name}."{n}", 0) + EXCLUDED."{n}"'
                      for n in sums)
    columns = ", ".join(f'"{n}"' for n in names)
    keys = ", ".join(f'"{n}"' for n in index)
    statement = (f"INSERT INTO {table.name} ({columns}) SELECT * FROM unnest({arrays}) "
                 f"ON CONFLICT ({keys}) DO UPDATE SET {added}")
    db.execute(sql_text(statement), {n: [row[n] for row in rows] for n in names})


def add_to_rollups(db: Session | Connection, dialect: str, rows: list[dict[str, Any]]) -> None:
    """Add normalised raw rows to both rollups (in the caller's transaction on a `dialect`
    database)."""
    groups, lints = group_rows(rows)
    for table, index, sums, batch in (
            (ROLLUP_TABLES[0], ["period", "start", "group_key"], SUMS, groups),
            (ROLLUP_TABLES[1], ["period", "start", "rule"], ("requests",), lints)):
        if not batch:
            continue
        if dialect == "postgresql":
            _pg_upsert(db, table, index, sums, batch)
        else:
            db.execute(_upsert(dialect, table, index, sums), batch)


def rollups_ready(engine: Engine) -> bool:
    """True when this database's rollups were built with this version's columns."""
    if not inspect(engine).has_table(RollupState.__tablename__):
        return False
    with engine.connect() as conn:
        built = conn.scalar(select(RollupState.columns).where(RollupState.name == STATE_NAME))
    return built == fingerprint()


def ensure_rollups(engine: Engine, wait_s: float = REBUILD_WAIT_S) -> None:
    """Build the rollups from the raw rows unless they are ready. Another process rebuilding
    at the same time holds the database's write lock: this one waits and finds them built."""
    deadline = time.monotonic() + wait_s
    while not rollups_ready(engine):
        try:
            with engine.begin() as conn:
                _lock(conn)
                if _built(conn):
                    return
                rebuild(conn)
            return
        except (OperationalError, InterfaceError):  # locked, or a wait that timed out
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _lock(conn: Connection) -> None:
    """Hold off other writers for the rebuild: a raw row is then either counted by it or
    written after it, with its own rollup upsert."""
    if conn.dialect.name == "postgresql":
        conn.execute(sql_text("LOCK TABLE requests, request_rollups, lint_rollups, "
                              "rollup_state IN SHARE ROW EXCLUSIVE MODE"))
    else:  # SQLite: a first statement that writes takes the database's write lock
        conn.execute(delete(RollupState).where(RollupState.name == ""))


def _built(conn: Connection) -> bool:
    built = conn.scalar(select(RollupState.columns).where(RollupState.name == STATE_NAME))
    return built == fingerprint()


def rebuild(conn: Connection, days_per_step: int = 1) -> None:
    """Replace both rollups with the sums of every raw row and mark them built: one
    INSERT ... SELECT ... GROUP BY per period for `request_rollups`; lint ids are split here,
    from the rows grouped per (minute, lint_ids), a day of rows at a time."""
    conn.execute(delete(RequestRollup))
    conn.execute(delete(LintRollup))
    R = RequestRecord
    keys = [getattr(R, name) for name in KEY_COLUMNS]
    sums = {column.name: column.element for column in raw_sums()}
    for period in PERIODS:
        start = start_sql(conn.dialect.name, R.ts, period)
        grouped = (select(literal_column(str(period)), start, _group_key_sql(conn), *keys,
                          *(func.coalesce(sums[name], 0) for name in SUMS))
                   .group_by(start, *keys))
        columns = ["period", "start", "group_key", *KEY_COLUMNS, *SUMS]
        conn.execute(insert(RequestRollup).from_select(columns, grouped))
    first, last = conn.execute(select(func.min(R.ts), func.max(R.ts))).one()
    if first is not None:
        step = timedelta(days=days_per_step)
        day = _as_utc(first).replace(hour=0, minute=0, second=0, microsecond=0)
        while day <= _as_utc(last):
            _rebuild_lints(conn, day, day + step)
            day += step
    conn.execute(delete(RollupState).where(RollupState.name == STATE_NAME))
    conn.execute(insert(RollupState), [{"name": STATE_NAME, "columns": fingerprint()}])


def _as_utc(ts: datetime) -> datetime:
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def _rebuild_lints(conn: Connection, day: datetime, end: datetime) -> None:
    """Lint rows of the raw rows in [day, end): a whole number of hours."""
    R = RequestRecord
    minute: ColumnElement[Any] = start_sql(conn.dialect.name, R.ts, 60)
    query = (select(minute.label("minute"), R.lint_ids, func.count().label("n"))
             .where(R.ts >= day, R.ts < end, R.lint_ids != "")
             .group_by(minute, R.lint_ids))
    lints: dict[tuple[int, int, str], int] = {}
    for row in conn.execute(query):
        for rule in lint_rules(row.lint_ids):
            for period in PERIODS:
                key = (period, int(row.minute) // period * period, rule)
                lints[key] = lints.get(key, 0) + int(row.n)
    if lints:
        conn.execute(insert(LintRollup), [{"period": p, "start": t, "rule": r, "requests": n}
                                          for (p, t, r), n in lints.items()])
