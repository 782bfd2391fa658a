"""`GET /api/stats`: the gateway's cache statistics as JSON (admin key).

`compute_stats(engine, prices, window_s, bucket_s)` reads the `requests` table of the
`RecordStore` with SQLAlchemy (grouping in SQL, so it stays cheap on a large table) and returns:
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
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, and_, case, cast, func, literal_column, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.sql.elements import ColumnElement
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admission import Overloaded
from gateway.errors import error_body
from gateway.pricing import PriceTable
from gateway.stats import RequestRecord

StateGetter = Callable[[], Any]  # () -> app.state, as create_app passes it
log = logging.getLogger("prefixgate.stats")
R = RequestRecord
BUCKETS_S = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400)
DEFAULT_WINDOW_S = 86400
MAX_WINDOW_S = 366 * 86400
TOP_N = 10
MAX_POINTS = 5000  # time-series points one answer may hold (the page draws at most 48)


def pick_bucket(window_s: int, points: int = 48) -> int:
    """The smallest standard bucket that splits the window into at most `points` buckets."""
    for size in BUCKETS_S:
        if window_s / size <= points:
            return size
    return BUCKETS_S[-1]


def _bucket(engine: Engine, bucket_s: int) -> ColumnElement[Any]:
    """The index of a row's time bucket (epoch seconds // bucket_s), per SQL dialect.

    The bucket size is an inline SQL literal, not a bound parameter: PostgreSQL sees the SELECT
    and GROUP BY expressions as the same only when they are textually equal, and two bound
    parameters ($1, $2) are not (`column "requests.ts" must appear in the GROUP BY clause`)."""
    size = literal_column(str(int(bucket_s)), Integer)
    if engine.dialect.name == "sqlite":
        return cast(func.strftime("%s", R.ts), Integer) // size  # floor: `/` is true division
    return cast(func.floor(func.extract("epoch", R.ts) / size), Integer)


def _ok() -> ColumnElement[Any]:
    return R.status < 400


def _paired(column: Any, other: Any) -> ColumnElement[Any]:
    """`column` on an answered row that has `other` too, else NULL: predicted and reported
    hits are compared over the same requests, never a prediction against a report that never
    came, and over the answered ones, as /metrics counts them (an Anthropic stream that fails
    after its message_start has a report, but no answer)."""
    return case((and_(_ok(), other.is_not(None)), column), else_=None)


def _sums() -> list[ColumnElement[Any]]:
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
        func.sum(_paired(R.predicted_cached_tokens, R.reported_cached_tokens))
        .label("predicted_cached_tokens"),
        func.sum(_paired(R.reported_cached_tokens, R.predicted_cached_tokens))
        .label("reported_cached_tokens"),
        func.count(R.predicted_cached_tokens).label("predicted_requests"),
        func.sum(R.prefill_saved_ms).label("prefill_saved_ms"),
        func.sum(R.latency_ms).label("latency_ms"),
    ]


_NUMBERS = ("requests", "errors", "client_errors", "failures", "prompt_tokens", "cached_tokens",
            "completion_tokens", "predicted_cached_tokens", "reported_cached_tokens",
            "predicted_requests", "prefill_saved_ms", "latency_ms")


def _empty() -> dict[str, float]:
    return {name: 0 for name in _NUMBERS} | {"cost_saved_usd": 0.0, "cost_usd": 0.0}


def _fold(acc: dict[str, float], row: Any, model: str, prices: PriceTable) -> None:
    for name in _NUMBERS:
        acc[name] += getattr(row, name) or 0
    price = prices.price(model)
    if price is not None:
        cached = int(row.cached_tokens or 0)
        acc["cost_saved_usd"] += price.saved(cached)
        acc["cost_usd"] += price.cost(int(row.prompt_tokens or 0), cached,
                                      int(row.completion_tokens or 0))


def _finish(acc: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {k: (round(v, 6) if isinstance(v, float) else int(v))
                           for k, v in acc.items()}
    prompt = acc["prompt_tokens"]
    out["hit_rate"] = round(acc["cached_tokens"] / prompt, 4) if prompt else 0.0
    out["avg_latency_ms"] = round(acc["latency_ms"] / acc["requests"], 2) if acc["requests"] else 0
    return out


def _unindexed(engine: Engine, key: Any) -> Any:
    """`key` as SQLite may not read through an index of its own (`key || ''`, same values).

    For `GROUP BY tenant` SQLite's planner walks the whole `tenant` index (rows come out
    grouped, no sort) instead of the `ts` index that finds the window's rows, so a one-hour
    window read every row of the table. Other databases plan by statistics and get the
    column as it is."""
    if engine.dialect.name == "sqlite" and isinstance(key, InstrumentedAttribute):
        return key.concat(literal_column("''"))
    return key


def _grouped(engine: Engine, key: Any, since: datetime, prices: PriceTable,
             ) -> dict[Any, dict[str, float]]:
    key = _unindexed(engine, key)
    query = (select(key.label("key"), R.model, *_sums()).where(R.ts >= since)
             .group_by(key, R.model))
    groups: dict[Any, dict[str, float]] = {}
    with engine.connect() as conn:
        for row in conn.execute(query):
            _fold(groups.setdefault(row.key, _empty()), row, row.model, prices)
    return groups


def _table(groups: dict[Any, dict[str, float]], name: str) -> list[dict[str, Any]]:
    rows = [{name: k if k not in (None, "") else "-", **_finish(v)} for k, v in groups.items()]
    return sorted(rows, key=lambda r: (-r["requests"], str(r[name])))


def _series(engine: Engine, since: datetime, bucket_s: int, prices: PriceTable,
            ) -> list[dict[str, Any]]:
    groups = _grouped(engine, _bucket(engine, bucket_s), since, prices)
    points = []
    for key in sorted(k for k in groups if k is not None):
        start = datetime.fromtimestamp(int(key) * bucket_s, UTC)
        points.append({"t": start.isoformat(), "epoch": int(key) * bucket_s,
                       **_finish(groups[key])})
    return points


def _lint_counts(engine: Engine, since: datetime) -> list[dict[str, Any]]:
    """The TOP_N lint rule ids on the most requests since `since` (ties by id)."""
    query = (select(R.lint_ids, func.count().label("n")).where(R.ts >= since)
             .group_by(R.lint_ids))
    counts: Counter[str] = Counter()
    with engine.connect() as conn:
        for row in conn.execute(query):
            for lint_id in filter(None, (row.lint_ids or "").split(",")):
                counts[lint_id.strip()] += int(row.n)
    # ties by rule id: Counter keeps first-seen order, i.e. the database's grouping order,
    # which differs between SQLite and PostgreSQL (and picks which tied rules make the top N)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_N]
    return [{"id": k, "requests": n} for k, n in ranked]


def _statuses(engine: Engine, since: datetime) -> list[dict[str, Any]]:
    query = (select(R.status, func.count().label("n")).where(R.ts >= since)
             .group_by(R.status).order_by(R.status))
    with engine.connect() as conn:
        return [{"status": int(r.status), "requests": int(r.n)} for r in conn.execute(query)]


def _sum_all(rows: Iterable[dict[str, float]]) -> dict[str, float]:
    total = _empty()
    for row in rows:
        for k in total:
            total[k] += row[k]
    return total


def compute_stats(engine: Engine, prices: PriceTable | None = None, *,
                  window_s: int = DEFAULT_WINDOW_S, bucket_s: int | None = None,
                  now: datetime | None = None) -> dict[str, Any]:
    """All dashboard numbers for the last `window_s` seconds (see the module docstring)."""
    prices = prices or PriceTable()
    now = now or datetime.now(UTC)
    since = now - timedelta(seconds=window_s)
    bucket_s = bucket_s or pick_bucket(window_s)
    by_model = _grouped(engine, R.model, since, prices)
    families = _grouped(engine, R.family, since, prices)
    families.pop(None, None)
    return {
        "generated_at": now.isoformat(), "window_s": window_s, "bucket_s": bucket_s,
        "totals": _finish(_sum_all(by_model.values())),
        "series": _series(engine, since, bucket_s, prices),
        "by_tenant": _table(_grouped(engine, R.tenant, since, prices), "tenant"),
        "by_model": _table(by_model, "model"),
        "by_replica": _table(_grouped(engine, R.replica, since, prices), "replica"),
        "by_backend": _table(_grouped(engine, R.backend, since, prices), "backend"),
        "lint": _lint_counts(engine, since),
        "families": _table(families, "family")[:TOP_N],
        "statuses": _statuses(engine, since),
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
