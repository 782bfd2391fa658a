"""The rollups are kept up at read time (gateway.rollups.catch_up), not by the stats writer: the
writer runs no rollup statement; readers catching up at once count each row once; a row
committed after a row with a larger id (several gateways on one PostgreSQL), or replayed from
a spill file after its minute was rolled up, is counted once; a catch-up committed while one
answer is being read does not change that answer.

The reference is `compute_stats(..., source="raw")` (see test_stats_rollups) and naive counts.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert

from gateway import rollups
from gateway.api_stats import compute_stats
from gateway.record_rows import to_json_row
from gateway.rollups import catch_up
from gateway.spill import SpillFile
from gateway.stats import RecordStore, RequestRecord, _row, default_spill_path, make_engine

from .pg_cluster import PgCluster
from .test_stats_rollups import (
    FEW,
    NOW,
    assert_every_row_once_per_period,
    assert_paths_agree,
    pg,
    random_rows,
    write,
)

__all__ = ["pg"]  # the PostgreSQL cluster fixture, shared with test_stats_rollups
ROLLUP_TABLES = ("stats_rollups", "stats_lint_rollups", "stats_rollup_state")
MONTH = 40 * 86400


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 's.db'}"


def _total(engine: Any, source: str) -> int:
    stats = compute_stats(engine, window_s=MONTH, now=NOW, source=source)
    return int(stats["totals"]["requests"])


def test_the_writer_runs_no_rollup_statement(tmp_path: Path) -> None:
    """The writer thread inserts raw rows only (rollups in its transaction cost the request
    path its throughput); the rows still reach the rollups when /api/stats reads."""
    store = RecordStore(_sqlite(tmp_path), batch_size=64, flush_interval_s=0.02)
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", seen)
    try:
        write(store, random_rows(40, 600))
        event.remove(store.engine, "before_cursor_execute", seen)
        assert any("INSERT INTO requests" in s for s in statements)
        assert [s for s in statements if any(t in s for t in ROLLUP_TABLES)] == []
        assert _total(store.engine, "rollup") == 600
        assert_paths_agree(store.engine, kinds=FEW)
        assert_every_row_once_per_period(store.engine)
    finally:
        store.close()


def test_reading_an_idle_database_writes_nothing(tmp_path: Path) -> None:
    """With no row above the watermark, /api/stats takes no lock and writes nothing (a
    dashboard refreshing every few seconds would otherwise take the writer's lock each time);
    with rows above it, it catches up."""
    store = RecordStore(_sqlite(tmp_path), flush_interval_s=0.02)
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement.lstrip().split()[0].upper())

    try:
        write(store, random_rows(51, 300))
        event.listen(store.engine, "before_cursor_execute", seen)
        assert _total(store.engine, "rollup") == 300
        assert "INSERT" in statements and "UPDATE" in statements
        statements.clear()
        assert _total(store.engine, "rollup") == 300
        assert statements and {"INSERT", "UPDATE", "DELETE"} & set(statements) == set()
    finally:
        store.close()


def test_an_in_memory_database_reads_rows_above_the_watermark_raw() -> None:
    """An in-memory database is one connection the writer thread shares: /api/stats does not
    catch up there (it could commit or roll back a batch half-way) and still answers right."""
    store = RecordStore("sqlite://", flush_interval_s=0.02)
    try:
        write(store, random_rows(52, 300))
        assert _total(store.engine, "rollup") == 300
        with store.engine.connect() as conn:
            assert rollups.watermark(conn) == 0
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        store.close()


def _catch_up_at_once(url: str, readers: int) -> None:
    """`readers` processes' worth of engines catch up at the same moment, in small chunks."""
    engines = [make_engine(url) for _ in range(readers)]
    barrier = threading.Barrier(readers)
    errors: list[BaseException] = []

    def run(engine: Any) -> None:
        try:
            barrier.wait()
            catch_up(engine, chunk=37)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for engine in engines:
        engine.dispose()
    assert errors == []


def _two_readers_count_each_row_once(url: str) -> None:
    store = RecordStore(url, batch_size=128, flush_interval_s=0.01)
    try:
        write(store, random_rows(41, 1500))
        _catch_up_at_once(url, 4)
        assert_every_row_once_per_period(store.engine)
        assert _total(store.engine, "rollup") == 1500
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        store.close()


def test_readers_catching_up_at_once_count_each_row_once(tmp_path: Path) -> None:
    _two_readers_count_each_row_once(_sqlite(tmp_path))


@pytest.mark.postgres
def test_readers_catching_up_at_once_count_each_row_once_on_postgres(pg: PgCluster) -> None:
    _two_readers_count_each_row_once(pg.new_database())


@pytest.mark.postgres
def test_a_row_committed_after_a_larger_id_is_counted_once_on_postgres(
        pg: PgCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gateway A takes ids for its batch; gateway B takes larger ones and commits first. A
    catch-up then must not move the watermark past A's rows, or once A commits they are in
    neither the rollups nor the rows read raw above the watermark."""
    url = pg.new_database()
    store = RecordStore(url, flush_interval_s=0.01)
    late = make_engine(url)
    try:
        write(store, random_rows(42, 200))
        catch_up(store.engine)
        with late.connect() as conn:
            slow = conn.begin()  # gateway A: its ids are taken, its batch not committed
            conn.execute(insert(RequestRecord), [_row(r) for r in random_rows(43, 50)])
            write(store, random_rows(44, 100))  # gateway B: larger ids, committed
            monkeypatch.setattr(rollups, "LOCK_TIMEOUT_MS", 200)
            catch_up(store.engine)  # cannot know A's rows yet: stops below them
            # B's rows, above the watermark, are read raw
            assert _total(store.engine, "rollup") == 300
            assert_paths_agree(store.engine, kinds=FEW)
            slow.commit()
        assert (store.count(), _total(store.engine, "rollup")) == (350, 350)
        assert_every_row_once_per_period(store.engine)
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        late.dispose()
        store.close()


def test_rows_written_since_the_last_catch_up_are_read_raw(tmp_path: Path) -> None:
    """While another connection holds SQLite's write lock, /api/stats cannot catch up (it
    waits out the busy timeout): it reads the rows above the watermark raw, same answer."""
    url = _sqlite(tmp_path)
    store = RecordStore(url, flush_interval_s=0.02)
    try:
        write(store, random_rows(49, 600))
        assert _total(store.engine, "rollup") == 600
        write(store, random_rows(50, 300))
        holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            raw = compute_stats(store.engine, window_s=MONTH, now=NOW, source="raw")
            rolled = compute_stats(store.engine, window_s=MONTH, now=NOW, source="rollup")
            with store.engine.connect() as conn:
                assert rollups.watermark(conn) == 600  # not caught up
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert rolled == raw and raw["totals"]["requests"] == 900
    finally:
        store.close()


def test_rows_replayed_after_their_minutes_were_rolled_up_are_counted_once(
        tmp_path: Path) -> None:
    """A gateway that spilled rows during an outage replays them when it starts again, after
    another one has rolled up their minutes: they are added to those minutes, once."""
    url = _sqlite(tmp_path)
    store = RecordStore(url, flush_interval_s=0.02)
    try:
        write(store, random_rows(45, 800))
        assert _total(store.engine, "rollup") == 800  # caught up: every minute rolled up
    finally:
        store.close()
    spill = SpillFile(default_spill_path(url))
    spill.append(to_json_row(_row(r)) for r in random_rows(46, 300))  # the same three days
    spill.close()
    again = RecordStore(url, flush_interval_s=0.02)
    try:
        assert again.flush() and again.spill.count == 0 and again.count() == 1100
        assert _total(again.engine, "rollup") == 1100
        assert_every_row_once_per_period(again.engine)
        assert_paths_agree(again.engine, kinds=FEW)
    finally:
        again.close()


def _answer_read_across_a_catch_up(url: str) -> None:
    """Rows are written and caught up by another gateway after this answer read its
    watermark: the answer is the database as it was when the reading began."""
    store = RecordStore(url, flush_interval_s=0.01)
    other = make_engine(url)
    fired: list[str] = []

    def meanwhile(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM stats_rollups" in statement and not fired:
            fired.append(statement)
            with other.begin() as conn:
                conn.execute(insert(RequestRecord), [_row(r) for r in random_rows(48, 400)])
            catch_up(other)

    try:
        write(store, random_rows(47, 600))
        before = compute_stats(store.engine, window_s=MONTH, now=NOW, source="raw")
        event.listen(store.engine, "after_cursor_execute", meanwhile)
        during = compute_stats(store.engine, window_s=MONTH, now=NOW, source="rollup")
        event.remove(store.engine, "after_cursor_execute", meanwhile)
        assert fired and during == before
        assert _total(store.engine, "rollup") == 1000
        assert_paths_agree(store.engine, kinds=FEW)
    finally:
        other.dispose()
        store.close()


def test_an_answer_read_across_a_catch_up_counts_rows_once(tmp_path: Path) -> None:
    _answer_read_across_a_catch_up(_sqlite(tmp_path))


@pytest.mark.postgres
def test_an_answer_read_across_a_catch_up_counts_rows_once_on_postgres(pg: PgCluster) -> None:
    _answer_read_across_a_catch_up(pg.new_database())
