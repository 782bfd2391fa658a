"""The additive sums /api/stats is made of, from raw rows, or from the per-minute, per-hour and
per-day rollups (gateway.rollups).

A `Span` is what a query covers: every row from `since` on. With rollup levels, the rows
before the first minute boundary at or after `since` (the window's partial first minute) are
read raw, the whole minutes up to the first hour boundary from minute rollups, the whole hours
up to the first day boundary from hour rollups, and the days from there on from day rollups;
the rollups hold the rows up to their watermark (an id), so the rows above it after the first
minute boundary are read raw too (found through the primary key). The queries of one answer
run on one connection that sees one state of the database (gateway.rollups.read_snapshot).
The parts are added before any ratio or price is taken, so the result is what the raw rows
alone give (integer sums exactly; float sums up to the order of addition, which SQL leaves
unspecified anyway).

Sums: requests, errors (status >= 400), client_errors (4xx), failures (5xx), prompt / cached /
completion tokens, predicted and reported cached tokens summed over the answered requests
that have both (see `paired`), the requests with a prediction, prefill time saved, latency.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Integer, and_, case, cast, func, literal_column, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.sql.elements import ColumnElement

from gateway.stats_tables import LintRollup, RequestRecord, RequestRollup

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
R = RequestRecord
U = RequestRollup
L = LintRollup
NUMBERS = ("requests", "errors", "client_errors", "failures", "prompt_tokens", "cached_tokens",
           "completion_tokens", "predicted_cached_tokens", "reported_cached_tokens",
           "predicted_requests", "prefill_saved_ms", "latency_ms")
Sums = dict[str, Any]  # NUMBERS -> the database's sum (None where SQL's SUM saw no value)


class Span(NamedTuple):
    """Rows from `since` on: raw up to the first level's start, then each level's rollups
    (period seconds, first start as an epoch second; periods ascending) up to the next's."""

    since: datetime
    levels: tuple[tuple[int, int], ...] = ()
    watermark: int = 0  # the rollups hold the rows with id <= watermark

    @property
    def raw_until(self) -> datetime | None:
        """Where raw rows end (None: they do not)."""
        return EPOCH + timedelta(seconds=self.levels[0][1]) if self.levels else None

    def rollups(self) -> list[tuple[int, int, int | None]]:
        """The rollup parts: (period, first start, end start or None)."""
        ends: list[int | None] = [start for _, start in self.levels[1:]]
        ends.append(None)
        return [(period, start, end) for (period, start), end in zip(self.levels, ends,
                                                                     strict=False)]

    def for_bucket(self, bucket_s: int) -> Span:
        """This span without the levels whose periods do not divide `bucket_s` (nor any
        after them): a time series reads only rollup rows that fall in one bucket."""
        levels = []
        for period, start in self.levels:
            if bucket_s % period:
                break
            levels.append((period, start))
        return Span(self.since, tuple(levels), self.watermark)


def lint_rules(lint_ids: str | None) -> list[str]:
    """The rule ids of one row's comma-separated `lint_ids`, as counted per request."""
    return [rule.strip() for rule in filter(None, (lint_ids or "").split(","))]


def _literal(value: int) -> ColumnElement[Any]:
    """An inline integer: PostgreSQL matches SELECT and GROUP BY expressions textually, and two
    bound parameters ($1, $2) are not equal (`must appear in the GROUP BY clause`)."""
    return literal_column(str(int(value)), Integer)


def bucket_sql(dialect: str, ts: Any, bucket_s: int) -> ColumnElement[Any]:
    """The index of a timestamp's bucket (epoch seconds // bucket_s), per SQL dialect."""
    size = _literal(bucket_s)
    if dialect == "sqlite":
        return cast(func.strftime("%s", ts), Integer) // size  # floor: `/` is true division
    return cast(func.floor(func.extract("epoch", ts) / size), Integer)


def start_sql(dialect: str, ts: Any, period: int) -> ColumnElement[Any]:
    """The epoch second a timestamp's period starts at (as gateway.rollups.start_of)."""
    return cast(bucket_sql(dialect, ts, period), BigInteger) * _literal(period)


def _ok() -> ColumnElement[Any]:
    return R.status < 400


def paired(column: Any, other: Any) -> ColumnElement[Any]:
    """`column` on an answered row that has `other` too, else NULL: predicted and reported
    hits are compared over the same requests, never a prediction against a report that never
    came, and over the answered ones, as /metrics counts them (an Anthropic stream that fails
    after its message_start has a report, but no answer)."""
    return case((and_(_ok(), other.is_not(None)), column), else_=None)


def raw_sums() -> list[ColumnElement[Any]]:
    """NUMBERS over raw rows."""
    ok = _ok()
    return [
        func.count().label("requests"),
        func.sum(case((ok, 0), else_=1)).label("errors"),
        func.sum(case((R.status >= 500, 0), (R.status >= 400, 1), else_=0)).label("client_errors"),
        func.sum(case((R.status >= 500, 1), else_=0)).label("failures"),
        # every row's tokens: a request cut short or failed mid-stream keeps the work it was
        # given (as /metrics counts it); one refused before any work has none
        func.sum(R.prompt_tokens).label("prompt_tokens"),
        func.sum(R.cached_tokens).label("cached_tokens"),
        func.sum(R.completion_tokens).label("completion_tokens"),
        func.sum(paired(R.predicted_cached_tokens, R.reported_cached_tokens))
        .label("predicted_cached_tokens"),
        func.sum(paired(R.reported_cached_tokens, R.predicted_cached_tokens))
        .label("reported_cached_tokens"),
        func.count(R.predicted_cached_tokens).label("predicted_requests"),
        func.sum(R.prefill_saved_ms).label("prefill_saved_ms"),
        func.sum(R.latency_ms).label("latency_ms"),
    ]


def _rollup_sums() -> list[ColumnElement[Any]]:
    """NUMBERS over rollup rows (integer sums cast: PostgreSQL sums BIGINT as NUMERIC)."""
    def total(value: Any, name: str) -> ColumnElement[Any]:
        return cast(func.sum(value), BigInteger).label(name)

    return [
        total(U.requests, "requests"),
        total(case((U.status >= 400, U.requests), else_=0), "errors"),
        total(case((U.status >= 500, 0), (U.status >= 400, U.requests), else_=0),
              "client_errors"),
        total(case((U.status >= 500, U.requests), else_=0), "failures"),
        *(total(getattr(U, name), name) for name in (
            "prompt_tokens", "cached_tokens", "completion_tokens", "predicted_cached_tokens",
            "reported_cached_tokens", "predicted_requests")),
        func.sum(U.prefill_saved_ms).label("prefill_saved_ms"),
        func.sum(U.latency_ms).label("latency_ms"),
    ]


def _unindexed(conn: Connection, key: Any) -> Any:
    """`key` as SQLite may not read through an index of its own (`key || ''`, same values).

    For `GROUP BY tenant` SQLite's planner walks the whole `tenant` index (rows come out
    grouped, no sort) instead of the `ts` index that finds the window's rows, so a one-hour
    window read every row of the table. Other databases plan by statistics and get the
    column as it is."""
    if conn.dialect.name == "sqlite" and isinstance(key, InstrumentedAttribute):
        return key.concat(literal_column("''"))
    return key


def _add(into: dict[Any, Sums], key: Any, row: Any) -> None:
    """Add one result row's NUMBERS to `into[key]` (None, SQL's empty sum, adds nothing)."""
    have = into.get(key)
    if have is None:
        into[key] = {name: getattr(row, name) for name in NUMBERS}
        return
    for name in NUMBERS:
        value = getattr(row, name)
        if value is not None:
            have[name] = value if have[name] is None else have[name] + value


def _in(table: Any, part: tuple[int, int, int | None]) -> list[ColumnElement[bool]]:
    period, first, end = part
    return [table.period == period, table.start >= first,
            *([table.start < end] if end is not None else [])]


def _raw_parts(conn: Connection, span: Span) -> list[list[ColumnElement[bool]]]:
    """Where the raw rows of `span` are: every row from `since` on (no rollups), or the
    partial first minute and the rows above the watermark after it. The latter are found
    through the primary key: SQLite's planner is kept off the `ts` index (a whole window of
    rows) by comparing an expression of `ts`, not the column."""
    until = span.raw_until
    if until is None:
        return [[R.ts >= span.since]]
    ts = func.coalesce(R.ts, R.ts) if conn.dialect.name == "sqlite" else R.ts
    return [[R.ts >= span.since, R.ts < until], [R.id > span.watermark, ts >= until]]


def _rollup_key(name: str) -> Any:
    """A rollup column as the raw rows hold it (NULL back where `nulls` says so)."""
    bit = {"replica": 1, "family": 2}.get(name)
    column = getattr(U, name)
    if bit is None:
        return column
    return case((U.nulls.op("&")(_literal(bit)) != _literal(0), None), else_=column)


def _grouped_by(conn: Connection, raw_key: Any, rollup_key: Any, span: Span,
                ) -> dict[tuple[Any, str], Sums]:
    out: dict[tuple[Any, str], Sums] = {}
    for where in _raw_parts(conn, span):
        raw = (select(raw_key.label("key"), R.model, *raw_sums()).where(*where)
               .group_by(raw_key, R.model))
        for row in conn.execute(raw):
            _add(out, (row.key, row.model), row)
    for part in span.rollups():
        rolled = (select(rollup_key.label("key"), U.model, *_rollup_sums())
                  .where(*_in(U, part)).group_by(rollup_key, U.model))
        for row in conn.execute(rolled):
            _add(out, (row.key, row.model), row)
    return out


def grouped(conn: Connection, key: str, span: Span) -> dict[tuple[Any, str], Sums]:
    """(value of column `key`, model) -> sums, over `span`."""
    return _grouped_by(conn, _unindexed(conn, getattr(R, key)), _rollup_key(key), span)


def bucketed(conn: Connection, bucket_s: int, span: Span) -> dict[tuple[Any, str], Sums]:
    """(bucket index = epoch // bucket_s, model) -> sums over `span`: each rollup period it
    reads must hold whole buckets' worth (`bucket_s` a multiple of the period)."""
    for period, _, _ in span.rollups():
        if bucket_s % period:
            raise ValueError(f"a {bucket_s} s bucket splits a {period} s rollup period")
    dialect = conn.dialect.name
    return _grouped_by(conn, bucket_sql(dialect, R.ts, bucket_s),
                       U.start // _literal(bucket_s), span)


def lint_counts(conn: Connection, span: Span) -> Counter[str]:
    """Requests per lint rule id over `span`."""
    counts: Counter[str] = Counter()
    for where in _raw_parts(conn, span):
        raw = select(R.lint_ids, func.count().label("n")).where(*where).group_by(R.lint_ids)
        for row in conn.execute(raw):
            for rule in lint_rules(row.lint_ids):
                counts[rule] += int(row.n)
    for part in span.rollups():
        rolled = (select(L.rule, func.sum(L.requests).label("n"))
                  .where(*_in(L, part)).group_by(L.rule))
        for row in conn.execute(rolled):
            counts[row.rule] += int(row.n)
    return counts


def status_counts(conn: Connection, span: Span) -> Counter[int]:
    """Requests per HTTP status over `span`."""
    counts: Counter[int] = Counter()
    for where in _raw_parts(conn, span):
        raw = select(R.status, func.count().label("n")).where(*where).group_by(R.status)
        for row in conn.execute(raw):
            counts[int(row.status)] += int(row.n)
    for part in span.rollups():
        rolled = (select(U.status, func.sum(U.requests).label("n"))
                  .where(*_in(U, part)).group_by(U.status))
        for row in conn.execute(rolled):
            counts[int(row.status)] += int(row.n)
    return counts
