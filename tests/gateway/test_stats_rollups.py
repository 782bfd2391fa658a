"""The per-minute, per-hour and per-day rollups behind /api/stats: whatever path rows took into the
database (batches, one by one after a refused batch, spill replay, two writers on one file, rows
written before rollups existed), `compute_stats` over the rollups answers exactly what it answers
over the raw rows, for windows and buckets of every kind, on SQLite and on PostgreSQL.

The reference is `compute_stats(..., source="raw")`, the raw-row computation /api/stats made
before rollups existed (itself checked against naive recomputations in test_dashboard_stats and
test_reliability_stats), plus a naive count here. Floats in the rows are multiples of 1/4, so
their sums are exact in any order and the answers can be compared with `==`.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, func, insert, select, text

from gateway.api_stats import compute_stats
from gateway.record_rows import to_json_row
from gateway.rollups import catch_up, rollups_ready
from gateway.spill import SpillFile
from gateway.stats import RecordStore, RequestRecord, _row, default_spill_path
from gateway.stats_tables import RequestRollup

from .pg_cluster import PgCluster, started_cluster

NOW = datetime(2026, 3, 9, 12, 34, 56, 789012, tzinfo=UTC)
SPAN_S = 3 * 86400  # rows spread over the three days before NOW
WINDOWS = (1800, 3600, 3601, 7217, 86400, 2 * 86400 + 123, 40 * 86400)
BUCKETS = (None, 45, 60, 90, 300, 3600, 86400)
FEW = ((7217, 2 * 86400 + 123), (None, 90, 300))  # windows, buckets: the rollup path, briefly
STATUSES = (200, 200, 200, 201, 400, 429, 499, 500, 502)
# text that array literals and CSV must quote or escape: quotes, braces, commas, backslashes
TENANTS = ("acme", "beta", "", "γ", 'q"uo{te},\\ \'s')
LINTS = ("", "", "PL001", "PL001,PL004", "PL004, PL009", "PL002,PL002", " ,PL007")


def random_rows(seed: int, n: int, end: datetime = NOW) -> list[dict[str, Any]]:
    """Rows over many minutes, tenants, models, replicas and families (None and '' too),
    statuses and lint ids; some exactly on a minute boundary, some after `end`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 17 == 0:  # on a minute boundary
            ts = (end - timedelta(minutes=rng.randrange(SPAN_S // 60))).replace(
                second=0, microsecond=0)
        else:
            ts = end - timedelta(seconds=rng.uniform(-120, SPAN_S))
        prompt = rng.randrange(0, 5000)
        predicted = rng.choice([None, rng.randrange(0, prompt + 1)])
        reported = rng.choice([None, rng.randrange(0, prompt + 1)])
        rows.append(dict(
            ts=ts, request_id=f"s{seed}-{i}", tenant=rng.choice(TENANTS),
            model=rng.choice(["gpt-4o", "gpt-4o-mini", "claude-sonnet-4", "local-model"]),
            backend=rng.choice(["upstream", "engine"]),
            replica=rng.choice([None, "", "http://r1:8000", "http://r2:8000"]),
            provider="openai", route="chat.completions", status=rng.choice(STATUSES),
            prompt_tokens=prompt, cached_tokens=rng.randrange(0, prompt + 1),
            completion_tokens=rng.randrange(0, 400), predicted_cached_tokens=predicted,
            reported_cached_tokens=reported, latency_ms=rng.randrange(0, 40000) / 4,
            prefill_saved_ms=rng.randrange(0, 4000) / 4, lint_ids=rng.choice(LINTS),
            family=rng.choice([None, "", "fam-a", "fam-b", "NULL"])))
    return rows


def assert_paths_agree(engine: Any, now: datetime = NOW,
                       kinds: tuple[tuple[Any, ...], ...] = (WINDOWS, BUCKETS)) -> int:
    """Raw and rollup answers are equal for every window and bucket; how many were compared."""
    assert rollups_ready(engine)
    compared = 0
    windows, buckets = kinds
    for window in windows:
        for bucket in buckets:
            if bucket is not None and window / bucket > 5000:
                continue
            raw = compute_stats(engine, window_s=window, bucket_s=bucket, now=now, source="raw")
            for source in ("rollup", "auto") if kinds != FEW else ("rollup",):
                rolled = compute_stats(engine, window_s=window, bucket_s=bucket, now=now,
                                       source=source)
                assert rolled == raw, (window, bucket, source, _first_difference(raw, rolled))
            compared += 1
    return compared


def assert_every_row_once_per_period(engine: Any) -> None:
    """Caught up, the rollups of each period hold every raw row once."""
    catch_up(engine)
    U = RequestRollup
    with engine.connect() as conn:
        n = conn.scalar(select(func.count(RequestRecord.id)))
        per_period = set(conn.execute(select(U.period, func.sum(U.requests)).group_by(U.period)))
    assert n and per_period == {(60, n), (3600, n), (86400, n)}


def _first_difference(raw: dict[str, Any], rolled: dict[str, Any]) -> Any:
    for name in raw:
        if raw[name] != rolled[name]:
            if isinstance(raw[name], list):
                pairs = [(a, b) for a, b in zip(raw[name], rolled[name], strict=False) if a != b]
                return name, [{k: (a[k], b[k]) for k in a if a[k] != b[k]} for a, b in pairs[:1]]
            return name, raw[name], rolled[name]
    return None


def naive_statuses(rows: list[dict[str, Any]], since: datetime) -> list[dict[str, int]]:
    counts = Counter(r["status"] for r in rows if r["ts"] >= since)
    return [{"status": s, "requests": n} for s, n in sorted(counts.items())]


def write(store: RecordStore, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        store.add(row)
    assert store.flush()


def test_rollups_answer_what_the_raw_rows_answer(tmp_path: Path) -> None:
    rows = random_rows(1, 3000)
    store = RecordStore(f"sqlite:///{tmp_path / 's.db'}", batch_size=97, flush_interval_s=0.02)
    try:
        write(store, rows)
        assert store.count() == len(rows)
        assert assert_paths_agree(store.engine) >= 40
        stats = compute_stats(store.engine, window_s=86400, now=NOW, source="rollup")
        assert stats["statuses"] == naive_statuses(rows, NOW - timedelta(days=1))
        week = compute_stats(store.engine, window_s=7 * 86400, now=NOW, source="rollup")
        assert week["totals"]["requests"] == len(rows)
        assert week["totals"]["latency_ms"] == sum(r["latency_ms"] for r in rows)
        # a window starting on a minute boundary has no raw edge
        on_minute = NOW.replace(second=0, microsecond=0)
        assert_paths_agree(store.engine, now=on_minute, kinds=FEW)
        # nor, on an hour boundary, minute rows; nor, on a day boundary, hour rows
        assert_paths_agree(store.engine, now=on_minute.replace(minute=0), kinds=FEW)
        assert_paths_agree(store.engine, now=on_minute.replace(hour=0, minute=0), kinds=FEW)
    finally:
        store.close()


def test_a_row_refused_alone_is_in_neither_the_raw_rows_nor_the_rollups(
        tmp_path: Path) -> None:
    """A refused batch is written one row at a time; the refused row leaves no sums behind."""
    rows = random_rows(2, 400)
    store = RecordStore(f"sqlite:///{tmp_path / 's.db'}", batch_size=64, flush_interval_s=0.02)

    def refuse(_conn: Any, _cursor: Any, _statement: str, params: Any, *_: Any) -> None:
        if "s2-13'" in str(params) or "'s2-13'" in repr(params):
            raise ValueError("refused by a constraint")

    event.listen(store.engine, "before_cursor_execute", refuse)
    try:
        write(store, rows)
        assert (store.count(), store.lost) == (len(rows) - 1, 1)
        stats = compute_stats(store.engine, window_s=30 * 86400, now=NOW, source="rollup")
        assert stats["totals"]["requests"] == len(rows) - 1
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        store.close()


def test_spilled_rows_replayed_at_start_are_in_the_rollups(tmp_path: Path) -> None:
    """Rows left in the spill file by an outage are replayed by the next gateway; their
    rollups come with them."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    spill = SpillFile(default_spill_path(url))
    spill.append(to_json_row(_row(r)) for r in random_rows(3, 700))
    spill.close()
    store = RecordStore(url, flush_interval_s=0.02)
    try:
        write(store, random_rows(4, 300))
        assert store.spill.count == 0 and store.count() == 1000
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        store.close()


def test_two_writers_on_one_sqlite_file_keep_the_rollups_exact(tmp_path: Path) -> None:
    """Two gateway workers, each with its own store on one file, write at the same time."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    stores = [RecordStore(url, batch_size=50, flush_interval_s=0.01) for _ in range(2)]
    batches = [random_rows(5, 1500), random_rows(6, 1500)]
    threads = [threading.Thread(target=write, args=(s, b)) for s, b in zip(stores, batches,
                                                                          strict=True)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert stores[0].count() == 3000 and stores[0].lost == stores[1].lost == 0
        assert_paths_agree(stores[1].engine, kinds=FEW)
    finally:
        for store in stores:
            store.close()


def test_a_database_written_before_rollups_is_backfilled_once(tmp_path: Path) -> None:
    """An older gateway's database has raw rows and no rollups: opening it builds them, and
    rows written after add to them."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = create_engine(url)
    RequestRecord.__table__.create(old)
    with old.begin() as conn:
        conn.execute(insert(RequestRecord), [_row(r) for r in random_rows(7, 2500)])
    old.dispose()
    store = RecordStore(url, flush_interval_s=0.02)
    try:
        assert store.count() == 2500
        assert_every_row_once_per_period(store.engine)
        assert_paths_agree(store.engine, kinds=FEW)
        write(store, random_rows(8, 500))
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        store.close()
    again = RecordStore(url)  # built once: a reopen does not add the raw rows a second time
    try:
        assert assert_paths_agree(again.engine, kinds=FEW)
    finally:
        again.close()


def test_rollups_missing_a_column_are_rebuilt(tmp_path: Path) -> None:
    """Rollups built by a version without one of this version's columns: the column is added
    and the rollups rebuilt from the raw rows, not summed from NULL."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = RecordStore(url, flush_interval_s=0.02)
    write(store, random_rows(9, 800))
    store.close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE stats_rollups DROP COLUMN latency_ms"))
        conn.execute(text("UPDATE stats_rollup_state SET columns = 'an older version'"))
    assert not rollups_ready(engine)
    engine.dispose()
    store = RecordStore(url, flush_interval_s=0.02)
    try:
        with store.session() as session:
            assert None not in set(session.scalars(select(RequestRollup.latency_ms)))
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        store.close()


def test_a_timestamp_with_an_offset_is_stored_at_its_instant(tmp_path: Path) -> None:
    """SQLite keeps a datetime's fields and drops its offset: a record stamped 10:00+02:00
    (08:00 UTC) was counted as 10:00 UTC, inside a window that ends at 09:30 UTC and starts
    at 08:30, and put in the 10:00 bucket."""
    store = RecordStore(f"sqlite:///{tmp_path / 's.db'}", flush_interval_s=0.02)
    plus2 = timezone(timedelta(hours=2))
    try:
        write(store, [dict(random_rows(10, 1)[0], ts=datetime(2026, 3, 9, 10, 0, tzinfo=plus2)),
                      dict(random_rows(11, 1)[0], ts=datetime(2026, 3, 9, 11, 0, tzinfo=plus2))])
        now = datetime(2026, 3, 9, 9, 30, tzinfo=UTC)
        hour = compute_stats(store.engine, window_s=3600, bucket_s=3600, now=now)
        assert hour["totals"]["requests"] == 1
        assert [p["t"] for p in hour["series"]] == ["2026-03-09T09:00:00+00:00"]
    finally:
        store.close()


# ------------------------------------------------------------------------------ PostgreSQL


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    yield from started_cluster()


@pytest.mark.postgres
def test_rollups_answer_what_the_raw_rows_answer_on_postgres(pg: PgCluster) -> None:
    url = pg.new_database()
    old = create_engine(url)
    RequestRecord.__table__.create(old)
    with old.begin() as conn:  # written before rollups existed: backfilled on open
        conn.execute(insert(RequestRecord), [_row(r) for r in random_rows(12, 1000)])
    old.dispose()
    stores = [RecordStore(url, batch_size=50, flush_interval_s=0.01) for _ in range(2)]
    threads = [threading.Thread(target=write, args=(s, random_rows(13 + k, 1000)))
               for k, s in enumerate(stores)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert stores[0].count() == 3000
        assert_every_row_once_per_period(stores[0].engine)
        assert assert_paths_agree(stores[0].engine) >= 40
    finally:
        for store in stores:
            store.close()


@pytest.mark.postgres
def test_a_batch_without_replicas_or_families_is_rolled_up_on_postgres(pg: PgCluster) -> None:
    """An embedded-engine gateway's rows have no replica, family or lint ids: a batch whose
    columns are all NULL still reaches the rollups (PostgreSQL gets each column as an array)."""
    store = RecordStore(pg.new_database(), flush_interval_s=0.01)
    try:
        write(store, [dict(r, replica=None, family=None, lint_ids="")
                      for r in random_rows(20, 300)])
        assert (store.count(), store.lost) == (300, 0)
        week = compute_stats(store.engine, window_s=7 * 86400, now=NOW, source="rollup")
        assert week["totals"]["requests"] == 300 and week["lint"] == []
        assert assert_paths_agree(store.engine, kinds=FEW)
    finally:
        store.close()
