"""`GET /api/stats`: the gateway's cache statistics as JSON (admin key).

`compute_stats(engine, prices, window_s, bucket_s)` reads the `RecordStore`'s database with
SQLAlchemy, grouping in SQL: windows over 15 minutes first bring the rollups up to date
(gateway.rollups.catch_up), then read whole days, hours and minutes from them and only the
partial first minute and the rows written since from the `requests` table, so a refresh over
days stays cheap on a busy gateway (gateway.stats_sums). It returns:
totals, a time series (hit rate, tokens, prefill time and money saved per bucket), breakdowns
per tenant / model / replica, predicted vs reported upstream hits, the most frequent lint
findings and prompt families. The dashboard and `prefixgate stats` show exactly these numbers.

Hit rate = cached prompt tokens / prompt tokens over every request (a request cut short or
failed mid-stream keeps the work it was given, as /metrics counts it; one refused before any
work has none). Predicted vs reported hits are summed over the answered requests (status <
400) that have both (a stream cut before the upstream reported, or an upstream that reports no
cached tokens, has a prediction with nothing to compare it to), as
`prefixgate_upstream_*_cached_tokens_total` counts them.
`errors` (status >= 400) splits into `client_errors` (4xx: validation, auth, limits, a client
that went away) and `failures` (5xx: the gateway or its backend failed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admission import Overloaded
from gateway.errors import error_body
from gateway.pricing import PriceTable
from gateway.rollups import (
    EPOCH,
    PERIODS,
    catch_up,
    read_snapshot,
    shared_connection,
    watermark,
)
from gateway.stats_sums import NUMBERS, Span, Sums, bucketed, grouped, lint_counts, status_counts

StateGetter = Callable[[], Any]  # () -> app.state, as create_app passes it
log = logging.getLogger("prefixgate.stats")
BUCKETS_S = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)
DEFAULT_WINDOW_S = 86400
MAX_WINDOW_S = 366 * 86400
TOP_N = 10
MAX_POINTS = 5000  # time-series points one answer may hold (the page draws at most 48)
# windows up to this read raw rows under source="auto": the ts index finds them, and their
# series buckets (30 s and less) split minutes anyway. An hour of a gateway serving 1M requests
# a day took 1.5 s from raw rows and 0.19 s from rollups (bench_stats --days 1)
RAW_WINDOW_S = 900
SOURCES = ("auto", "raw", "rollup")


def pick_bucket(window_s: int, points: int = 48) -> int:
    """The smallest standard bucket that splits the window into at most `points` buckets."""
    for size in BUCKETS_S:
        if window_s / size <= points:
            return size
    return BUCKETS_S[-1]


def _empty() -> dict[str, float]:
    return {name: 0 for name in NUMBERS} | {"cost_saved_usd": 0.0, "cost_usd": 0.0}


def _fold(acc: dict[str, float], sums: Sums, model: str, prices: PriceTable) -> None:
    for name in NUMBERS:
        acc[name] += sums[name] or 0
    price = prices.price(model)
    if price is not None:
        cached = int(sums["cached_tokens"] or 0)
        acc["cost_saved_usd"] += price.saved(cached)
        acc["cost_usd"] += price.cost(int(sums["prompt_tokens"] or 0), cached,
                                      int(sums["completion_tokens"] or 0))


def _finish(acc: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {k: (round(v, 6) if isinstance(v, float) else int(v))
                           for k, v in acc.items()}
    prompt = acc["prompt_tokens"]
    out["hit_rate"] = round(acc["cached_tokens"] / prompt, 4) if prompt else 0.0
    out["avg_latency_ms"] = round(acc["latency_ms"] / acc["requests"], 2) if acc["requests"] else 0
    return out


def _by_key(sums: dict[tuple[Any, str], Sums], prices: PriceTable) -> dict[Any, dict[str, float]]:
    """(key, model) sums folded per key, each model priced on its own, in model order (so
    the money, a float, is added up in one order whatever order the database grouped in)."""
    groups: dict[Any, dict[str, float]] = {}
    for (key, model), group in sorted(sums.items(), key=lambda kv: kv[0][1]):
        _fold(groups.setdefault(key, _empty()), group, model, prices)
    return groups


def _table(groups: dict[Any, dict[str, float]], name: str) -> list[dict[str, Any]]:
    """Rows by requests, then name; NULL and '' are both shown as `-` (NULL first on a tie,
    not in whichever order the database grouped them)."""
    def shown(key: Any) -> str:
        return "-" if key in (None, "") else str(key)

    ranked = sorted(groups.items(),
                    key=lambda kv: (-kv[1]["requests"], shown(kv[0]), kv[0] is not None))
    return [{name: shown(k) if k in (None, "") else k, **_finish(v)} for k, v in ranked]


def _series(conn: Connection, span: Span, bucket_s: int, prices: PriceTable,
            ) -> list[dict[str, Any]]:
    groups = _by_key(bucketed(conn, bucket_s, span), prices)
    points = []
    for key in sorted(k for k in groups if k is not None):
        start = datetime.fromtimestamp(int(key) * bucket_s, UTC)
        points.append({"t": start.isoformat(), "epoch": int(key) * bucket_s,
                       **_finish(groups[key])})
    return points


def _lint(conn: Connection, span: Span) -> list[dict[str, Any]]:
    """The TOP_N lint rule ids on the most requests (ties by id: the order the database
    groups in differs between SQLite and PostgreSQL, and picks which tied rules make it)."""
    ranked = sorted(lint_counts(conn, span).items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_N]
    return [{"id": k, "requests": n} for k, n in ranked]


def _statuses(conn: Connection, span: Span) -> list[dict[str, Any]]:
    return [{"status": status, "requests": n}
            for status, n in sorted(status_counts(conn, span).items())]


def _sum_all(rows: Iterable[dict[str, float]]) -> dict[str, float]:
    total = _empty()
    for row in rows:
        for k in total:
            total[k] += row[k]
    return total


def _ceil(ts: datetime, period_s: int) -> datetime:
    micros = (ts - EPOCH) // timedelta(microseconds=1)
    unit = period_s * 1_000_000
    return EPOCH + timedelta(microseconds=-(-micros // unit) * unit)


def _use_rollups(window_s: int, source: str) -> bool:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    return source == "rollup" or (source == "auto" and window_s > RAW_WINDOW_S)


def _catch_up(engine: Engine) -> None:
    """Bring the rollups up to date; on failure (a lock held too long) the rows above the
    watermark are read raw: slower, same answer."""
    if shared_connection(engine):
        return
    try:
        catch_up(engine)
    except SQLAlchemyError as exc:
        log.warning("stats rollups not caught up (%s); reading newer rows raw",
                    type(exc).__name__)


def _span(conn: Connection, since: datetime, rollups: bool, source: str) -> Span:
    """What to read: raw rows only (`rollups` False, or a database whose rollups are not
    built with this version's columns), or raw rows up to the first minute boundary, then
    minute, hour and day rollups, each from its first boundary on, and the raw rows above
    the watermark after that boundary."""
    mark = watermark(conn) if rollups else None
    if mark is None:
        if rollups and source == "rollup":
            raise ValueError("this database's rollups are not built")
        return Span(since)
    return Span(since, tuple((period, int(_ceil(since, period).timestamp()))
                             for period in PERIODS), mark)


def compute_stats(engine: Engine, prices: PriceTable | None = None, *,
                  window_s: int = DEFAULT_WINDOW_S, bucket_s: int | None = None,
                  now: datetime | None = None, source: str = "auto") -> dict[str, Any]:
    """All dashboard numbers for the last `window_s` seconds (see the module docstring).
    `source`: "raw" reads every row of the window; "rollup" reads whole days, hours and
    minutes from the rollups (the partial first minute from raw rows; a series reads only the
    periods that divide its bucket, raw rows for a bucket that is no whole number of minutes);
    "auto" takes the rollups for windows over RAW_WINDOW_S."""
    prices = prices or PriceTable()
    now = now or datetime.now(UTC)
    since = (now - timedelta(seconds=window_s)).astimezone(UTC)
    bucket_s = bucket_s or pick_bucket(window_s)
    rollups = _use_rollups(window_s, source)
    if rollups:
        _catch_up(engine)
    with read_snapshot(engine) as conn:
        return _answer(conn, _span(conn, since, rollups, source), now, window_s, bucket_s,
                       prices)


def _answer(conn: Connection, span: Span, now: datetime, window_s: int, bucket_s: int,
            prices: PriceTable) -> dict[str, Any]:
    by_model = _by_key(grouped(conn, "model", span), prices)
    families = _by_key(grouped(conn, "family", span), prices)
    families.pop(None, None)
    return {
        "generated_at": now.isoformat(), "window_s": window_s, "bucket_s": bucket_s,
        "totals": _finish(_sum_all(by_model.values())),
        "series": _series(conn, span.for_bucket(bucket_s), bucket_s, prices),
        "by_tenant": _table(_by_key(grouped(conn, "tenant", span), prices), "tenant"),
        "by_model": _table(by_model, "model"),
        "by_replica": _table(_by_key(grouped(conn, "replica", span), prices), "replica"),
        "by_backend": _table(_by_key(grouped(conn, "backend", span), prices), "backend"),
        "lint": _lint(conn, span),
        "families": _table(families, "family")[:TOP_N],
        "statuses": _statuses(conn, span),
        "prices": prices.as_json(),
    }


def _int_param(request: Request, name: str, default: int | None, high: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer number of seconds, got {raw!r}") from None
    if not 0 < value <= high:
        raise ValueError(f"{name} must be in 1..{high}, got {value}")
    return value


def _check_points(window_s: int, bucket_s: int | None) -> None:
    """A ValueError for a `bucket` that splits the window into more than MAX_POINTS points:
    `?window=31622400&bucket=1` took 10 s and answered 37 MB on 100k rows, one point a row."""
    if bucket_s is not None and window_s / bucket_s > MAX_POINTS:
        raise ValueError(f"bucket must be at least {-(-window_s // MAX_POINTS)} seconds for a "
                         f"{window_s} s window (at most {MAX_POINTS} points), got {bucket_s}")


def price_table(state: Any) -> PriceTable:
    """The app's price table, loaded once from `config.price_table`."""
    table = getattr(state, "prices", None)
    if table is None:
        table = PriceTable.load(getattr(state.config, "price_table", None))
        state.prices = table
    return table


def forbidden() -> JSONResponse:
    """The answer to a caller without the admin key."""
    return JSONResponse({"error": {"message": "admin key required", "type":
                                   "authentication_error", "param": None, "code": None}},
                        status_code=401)


def locked_out(err: Overloaded) -> JSONResponse:
    """The 429 for an address locked out after repeated wrong keys (gateway.auth_limit)."""
    return JSONResponse(error_body(err, "openai"), status_code=err.status,
                        headers={"retry-after": str(err.retry_after), "cache-control": "no-store"})


def database_unavailable(exc: SQLAlchemyError, state: Any) -> JSONResponse:
    """A 503 saying the stats database did not answer (an outage, not a gateway fault): the
    dashboard and `prefixgate stats` show this message instead of a bare 500, and the log
    gets one line instead of a traceback per dashboard refresh. Only the error's class is
    named (its text may carry the database's address)."""
    reason = type(exc.orig if isinstance(exc, DBAPIError) else exc).__name__
    pending = state.store.pending()
    log.warning("GET /api/stats: stats database unavailable (%s)", reason)
    message = (f"stats database unavailable ({reason}); {pending} records wait to be written "
               "and are counted once it answers")
    return JSONResponse({"error": {"message": message, "type": "api_error", "param": None,
                                   "code": "stats_database_unavailable"}},
                        status_code=503, headers={"retry-after": "15", "cache-control": "no-store"})


def _flushed_stats(state: Any, window_s: int, bucket_s: int | None) -> dict[str, Any]:
    state.store.flush(5.0)  # so a record added just before this call is counted
    return compute_stats(state.store.engine, price_table(state), window_s=window_s,
                         bucket_s=bucket_s)


def routes(state_getter: StateGetter | None = None) -> list[Route]:
    """`GET /api/stats?window=SECONDS&bucket=SECONDS` (admin key)."""
    def get_state(request: Request) -> Any:
        return state_getter() if state_getter is not None else request.app.state

    async def api_stats(request: Request) -> Response:
        state = get_state(request)
        try:
            if not await state.auth.is_admin(request):
                return forbidden()
        except Overloaded as err:
            return locked_out(err)
        try:
            window = _int_param(request, "window", DEFAULT_WINDOW_S, MAX_WINDOW_S)
            bucket = _int_param(request, "bucket", None, MAX_WINDOW_S)
            _check_points(window or DEFAULT_WINDOW_S, bucket)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        try:
            stats = await run_in_threadpool(_flushed_stats, state, window or DEFAULT_WINDOW_S,
                                            bucket)
        except SQLAlchemyError as exc:
            return database_unavailable(exc, state)
        return JSONResponse(stats, headers={"cache-control": "no-store"})

    return [Route("/api/stats", api_stats, methods=["GET"])]
