"""Issue 17, items 2-4 on SQLite and PostgreSQL: the stats API's queries, poisoned rows among
good ones, and a database outage (spill to disk, replay) with zero records lost."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from gateway.api_stats import compute_stats
from gateway.app import create_app
from gateway.stats import RecordStore, RequestRecord, default_spill_path

from .gateway_fakes import FakeBackend, asgi_client, fake_config
from .pg_cluster import PgCluster, pg_bin, started_cluster

ADMIN = "admin-key-for-tests"
CHAT = {"model": "fake-echo", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    yield from started_cluster()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: Any, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'stats.db'}"
    cluster: PgCluster = request.getfixturevalue("pg")
    return cluster.new_database()


def _record(i: int, now: datetime, **changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict(
        ts=now - timedelta(seconds=37 * i), request_id=f"req{i:04d}", tenant=f"t{i % 3}",
        model=("gpt-4o", "claude-3-5-sonnet", "local")[i % 3 if i % 5 else 0],
        backend="openai", replica=f"r{i % 2}", provider="openai", route="chat.completions",
        status=200 if i % 7 else 500, prompt_tokens=100 + i, cached_tokens=(i * 13) % 100,
        completion_tokens=5, latency_ms=10.0 + i, prefill_saved_ms=float(i),
        lint_ids="PL001,PL004" if i % 2 else "", family=f"f{i % 4}")
    row.update(changes)
    return row


def _naive(rows: list[dict[str, Any]], key: str) -> dict[Any, tuple[int, int, int]]:
    out: dict[Any, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in rows:
        acc = out[r[key]]
        acc[0] += 1  # every row's tokens: a failed or cut-short request keeps its work
        acc[1] += r["prompt_tokens"]
        acc[2] += r["cached_tokens"]
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def test_every_stats_query_matches_a_naive_count(db_url: str) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    rows = [_record(i, now) for i in range(90)]  # spread over the last ~55 minutes
    store = RecordStore(db_url, flush_interval_s=0.02)
    try:
        for row in rows:
            store.add(row)
        assert store.flush()
        for bucket_s in (60, 300, 3600):
            stats = compute_stats(store.engine, window_s=7200, bucket_s=bucket_s, now=now)
            assert stats["totals"]["requests"] == len(rows)
            for name, key in (("by_tenant", "tenant"), ("by_model", "model"),
                              ("by_replica", "replica"), ("families", "family")):
                got = {g[key]: (g["requests"], g["prompt_tokens"], g["cached_tokens"])
                       for g in stats[name]}
                assert got == _naive(rows, key), name
            buckets: dict[int, int] = defaultdict(int)
            for r in rows:
                buckets[int(r["ts"].timestamp()) // bucket_s * bucket_s] += 1
            assert {p["epoch"]: p["requests"] for p in stats["series"]} == dict(buckets)
            statuses = {s["status"]: s["requests"] for s in stats["statuses"]}
            assert statuses == {200: sum(r["status"] == 200 for r in rows),
                                500: sum(r["status"] == 500 for r in rows)}
            assert {x["id"]: x["requests"] for x in stats["lint"]} == {"PL001": 45, "PL004": 45}
    finally:
        store.close()


def test_top_lint_findings_are_ranked_the_same_on_every_database(db_url: str) -> None:
    """Most requests first, ties by rule id: the list (and which rules make its top ten) must
    not follow the order a database happens to group `lint_ids` strings in."""
    now = datetime.now(UTC).replace(microsecond=0)
    ids = [f"PL{n:03d}" for n in range(1, 15)]
    # every rule on one request, written in descending order; PL014 and PL013 on one more
    lint = [",".join(reversed(ids)), "PL014,PL013", ""]
    rows = [_record(i, now, lint_ids=text) for i, text in enumerate(lint)]
    store = RecordStore(db_url, flush_interval_s=0.02)
    try:
        for row in rows:
            store.add(row)
        assert store.flush()
        stats = compute_stats(store.engine, window_s=3600, now=now)
    finally:
        store.close()
    counts = {i: sum(i in r["lint_ids"].split(",") for r in rows) for i in ids}
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    assert [(x["id"], x["requests"]) for x in stats["lint"]] == ranked


async def test_stats_api_and_dashboard_answer_on_the_database(db_url: str, tmp_path: Path) -> None:
    app = create_app(fake_config(tmp_path, db_url=db_url, admin_key=ADMIN), backend=FakeBackend())
    try:
        async with asgi_client(app) as http:
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            auth = {"x-api-key": ADMIN}
            for window in ("60", "3600", "86400", "2592000"):
                r = await http.get("/api/stats", params={"window": window}, headers=auth)
                assert r.status_code == 200, r.text
                assert r.json()["totals"]["requests"] == 3
                assert sum(p["requests"] for p in r.json()["series"]) == 3
            assert (await http.get("/dashboard", headers=auth)).status_code == 200
    finally:
        app.state.store.close()


POISON = [
    {"model": "bad\u0000model", "error": "nul \u0000 inside"},
    {"model": "lone \ud800 surrogate", "tenant": "t\udfff"},
    {"model": "m" * 300, "tenant": "t" * 500, "lint_ids": "PL" * 400},
    {"prompt_tokens": 10**12, "cached_tokens": -(10**15), "latency_ms": float("nan"),
     "ttft_ms": float("inf")},
]


def test_poisoned_rows_never_take_their_batch_with_them(db_url: str) -> None:
    now = datetime.now(UTC)
    store = RecordStore(db_url, batch_size=64, flush_interval_s=0.05)
    try:
        rows = [_record(i, now) for i in range(40)]
        for k, poison in enumerate(POISON):
            rows.insert(7 + 9 * k, _record(100 + k, now, **poison))
        for row in rows:
            store.add(row)
        assert store.flush()
        assert (store.count(), store.lost) == (len(rows), 0)
        with store.session() as session:
            models = list(session.scalars(select(RequestRecord.model)))
            tenants = list(session.scalars(select(RequestRecord.tenant)))
        assert "badmodel" in models and "lone \ufffd surrogate" in models
        assert "m" * 256 in models and "t" * 128 in tenants
        assert all("\x00" not in m and len(m) <= 256 for m in models)
    finally:
        store.close()


def test_a_row_the_database_refuses_alone_is_isolated(db_url: str) -> None:
    store = RecordStore(db_url, batch_size=64, flush_interval_s=0.05)

    def refuse(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        batch = params if isinstance(params, list) else [params]
        if any(isinstance(p, dict | tuple) and "req0013" in str(p) for p in batch):
            raise ValueError("refused by a constraint")

    event.listen(store.engine, "before_cursor_execute", refuse)
    try:
        now = datetime.now(UTC)
        for i in range(30):
            store.add(_record(i, now))
        assert store.flush()
        assert (store.count(), store.lost, store.degraded) == (29, 1, False)
    finally:
        store.close()


class Outage:
    """Makes every statement on an engine fail while `down` (a dead database)."""

    def __init__(self, engine: Any) -> None:
        self.down = False
        event.listen(engine, "before_cursor_execute", self._hook)

    def _hook(self, *_: Any) -> None:
        if self.down:
            raise sqlite3.OperationalError("database is locked")


def _wait(predicate: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_sqlite_outage_spills_reports_degraded_and_replays(tmp_path: Path) -> None:
    app = create_app(fake_config(tmp_path, admin_key=ADMIN), backend=FakeBackend())
    store: RecordStore = app.state.store
    outage = Outage(store.engine)
    try:
        async with asgi_client(app) as http:
            assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            outage.down = True
            for _ in range(25):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert store.flush()
            health = (await http.get("/healthz")).json()
            assert health["status"] == "degraded" and health["database"] == "degraded"
            metrics = (await http.get("/metrics", headers={"x-api-key": ADMIN})).text
            assert _metric(metrics, "prefixgate_stats_records_pending") >= 25
            assert _metric(metrics, "prefixgate_stats_records_lost_total") == 0
            assert store.spill.path.exists()
            outage.down = False
            _wait(lambda: store.pending() == 0)
            health = (await http.get("/healthz")).json()
            assert health["status"] == "ok" and health["stats_lost"] == 0
        assert store.flush() and (store.count(), store.lost) == (26, 0)
        assert not store.spill.path.exists()
    finally:
        store.close()


class ReadOnly:
    """SQLite connections opened while `readonly` refuse every write as on a read-only file
    (`PRAGMA query_only`) and keep refusing after it is cleared, as a connection opened on
    a read-only file does; reads still answer."""

    def __init__(self, engine: Any) -> None:
        self.readonly = False
        event.listen(engine, "connect", self._connected)

    def _connected(self, dbapi_conn: Any, _record: Any) -> None:
        if self.readonly:
            dbapi_conn.execute("PRAGMA query_only = ON")


async def test_a_database_that_refuses_every_write_loses_no_record(tmp_path: Path) -> None:
    app = create_app(fake_config(tmp_path, admin_key=ADMIN), backend=FakeBackend())
    store: RecordStore = app.state.store
    readonly = ReadOnly(store.engine)
    try:
        async with asgi_client(app) as http:
            readonly.readonly = True
            store.engine.dispose()  # every connection from now on is read-only
            for _ in range(10):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert store.flush()
            with store.engine.connect() as conn:  # reads still answer
                assert conn.execute(select(RequestRecord.id)).all() == []
            health = (await http.get("/healthz")).json()
            assert health["database"] == "degraded" and health["stats_lost"] == 0
            assert store.pending() == 10
            readonly.readonly = False
            _wait(lambda: store.pending() == 0)
        assert store.flush() and (store.count(), store.lost) == (10, 0)
    finally:
        store.close()


def test_a_database_that_fails_at_commit_loses_no_record(tmp_path: Path) -> None:
    store = RecordStore(f"sqlite:///{tmp_path / 'c.db'}", flush_interval_s=0.02)
    failing = {"on": True}

    def commit(_conn: Any) -> None:  # an unwritable WAL file: statements run, commits fail
        if failing["on"]:
            raise sqlite3.OperationalError("disk I/O error")

    event.listen(store.engine, "commit", commit)
    try:
        now = datetime.now(UTC)
        for i in range(12):
            store.add(_record(i, now))
        assert store.flush()
        assert (store.lost, store.pending(), store.degraded) == (0, 12, True)
        failing["on"] = False
        _wait(lambda: store.pending() == 0)
        assert store.flush() and (store.count(), store.lost) == (12, 0)
    finally:
        store.close()


def _spilling_worker(url: str, flag: str, worker: int, n: int) -> None:
    """A gateway process's store: `n` rows, the database down while `flag` exists."""
    store = RecordStore(url, flush_interval_s=0.01, batch_size=16)

    def down(*_: Any) -> None:
        if os.path.exists(flag):
            raise sqlite3.OperationalError("database is locked")

    event.listen(store.engine, "before_cursor_execute", down)
    now = datetime.now(UTC)
    for i in range(n):
        store.add(_record(i, now, request_id=f"w{worker}-{i}"))
        time.sleep(0.002)
    _wait(lambda: store.pending() == 0)
    store.close()


def test_two_processes_sharing_a_spill_file_replay_each_row_once(tmp_path: Path) -> None:
    url, flag, n = f"sqlite:///{tmp_path / 'shared.db'}", str(tmp_path / "down"), 500
    RecordStore(url).close()  # the table, before two processes race to make it
    Path(flag).touch()
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_spilling_worker, args=(url, flag, w, n))
               for w in range(2)]
    for worker in workers:
        worker.start()
    spill = default_spill_path(url)
    _wait(lambda: spill.exists() and len(spill.read_text().splitlines()) >= n)  # both spill
    os.remove(flag)  # the database is back
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    store = RecordStore(url)
    try:
        with store.session() as session:
            ids = list(session.scalars(select(RequestRecord.request_id)))
        assert sorted(ids) == sorted(f"w{w}-{i}" for w in range(2) for i in range(n))
    finally:
        store.close()


def test_spilled_rows_survive_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = RecordStore(url, flush_interval_s=0.02)
    outage = Outage(store.engine)
    outage.down = True
    now = datetime.now(UTC)
    for i in range(12):
        store.add(_record(i, now))
    store.close()  # the gateway stops mid-outage: the rows wait on disk
    assert store.spill.count == 12 and store.lost == 0
    again = RecordStore(url, flush_interval_s=0.02)
    try:
        assert again.flush() and (again.count(), again.pending()) == (12, 0)
    finally:
        again.close()


def test_a_full_queue_spills_instead_of_growing(tmp_path: Path) -> None:
    store = RecordStore(f"sqlite:///{tmp_path / 'q.db'}", max_queue=4, flush_interval_s=0.02)
    outage = Outage(store.engine)
    outage.down = True
    now = datetime.now(UTC)
    for i in range(200):
        store.add(_record(i, now))
        assert store._queue.qsize() <= 4
    outage.down = False
    try:
        _wait(lambda: store.pending() == 0)
        assert store.flush() and (store.count(), store.lost) == (200, 0)
    finally:
        store.close()


@pytest.mark.postgres
async def test_postgres_stopped_and_restarted_loses_no_record(tmp_path: Path) -> None:
    pytest.importorskip("pg8000", reason="the pg8000 driver is not installed")
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) on this machine")
    cluster = PgCluster.start_new(bindir)
    app = create_app(fake_config(tmp_path, db_url=cluster.new_database(), admin_key=ADMIN),
                     backend=FakeBackend())
    store: RecordStore = app.state.store
    try:
        async with asgi_client(app) as http:
            for _ in range(10):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert store.flush()
            cluster.stop()
            for _ in range(40):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert store.flush()
            assert (await http.get("/healthz")).json()["database"] == "degraded"
            cluster.start()
            _wait(lambda: store.pending() == 0, 60)
            assert (await http.get("/healthz")).json()["status"] == "ok"
        assert store.flush() and (store.count(), store.lost) == (50, 0)
    finally:
        store.close()
        cluster.destroy()


@pytest.mark.parametrize("source", ["raw", "rollup"])
def test_every_stats_query_on_sqlite_reads_only_its_window(tmp_path: Path, source: str) -> None:
    """Each query /api/stats runs on SQLite finds its rows through an index: raw rows through
    the `ts` index, so a one-hour window reads an hour of rows however large the table is
    (SQLite's planner otherwise walks the whole `tenant` index to avoid sorting the GROUP BY),
    rollup rows through their primary key (period, start), raw rows above the rollups'
    watermark and those the catch-up adds through the primary key (id)."""
    now = datetime.now(UTC).replace(microsecond=0)
    store = RecordStore(f"sqlite:///{tmp_path / 'plan.db'}", flush_interval_s=0.02)
    statements: list[tuple[str, Any]] = []

    def seen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    try:
        for i in range(40):
            store.add(_record(i, now))
        assert store.flush()
        event.listen(store.engine, "before_cursor_execute", seen)
        compute_stats(store.engine, window_s=3600, now=now, source=source)
        event.remove(store.engine, "before_cursor_execute", seen)
        plans = {}
        with store.engine.connect() as conn:
            for statement, parameters in statements:
                rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
                plans[statement] = " / ".join(str(row[-1]) for row in rows)
    finally:
        store.close()
    # the catch-up's largest id: SQLite's min/max optimisation reads one row
    top = {s: p for s, p in plans.items() if "max(requests.id)" in s}
    assert set(top.values()) == ({"SEARCH requests"} if source == "rollup" else set())
    by_id = {s: p for s, p in plans.items() if "FROM requests" in s and "requests.id >" in s}
    raw = {s: p for s, p in plans.items()
           if "FROM requests" in s and s not in by_id and s not in top}
    rolled = {s: p for s, p in plans.items() if "FROM stats_rollups" in s
              or "FROM stats_lint_rollups" in s}
    assert len(raw) >= 7 and (len(rolled) >= 7) == (source == "rollup")
    assert (len(by_id) >= 7) == (source == "rollup")
    assert {s: p for s, p in raw.items() if "ix_requests_ts (ts>?" not in p} == {}
    assert {s: p for s, p in by_id.items() if "INTEGER PRIMARY KEY (rowid>?" not in p} == {}
    assert {s: p for s, p in rolled.items() if "_rollups_1 (period=? AND start>?" not in p} == {}
