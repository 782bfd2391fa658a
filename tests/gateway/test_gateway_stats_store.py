"""RecordStore: batched writes off the request path, no record lost on a clean shutdown, on
SQLite and (when a server can be reached or started here) on PostgreSQL."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from gateway.app import create_app
from gateway.stats import RecordStore, RequestRecord
from tests.support import free_port

from .gateway_fakes import FAKE_MODEL, FakeBackend, asgi_client, fake_config


def record(i: int, tenant: str = "t") -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", tenant=tenant, model="m", backend="embedded",
                         provider="openai", route="chat.completions", status=200,
                         prompt_tokens=i, cached_tokens=i // 2, completion_tokens=1,
                         latency_ms=1.0, lint_ids="PL001", stream=False)


def fill_and_close(url: str, n_threads: int = 4, per_thread: int = 150) -> None:
    store = RecordStore(url, batch_size=32, flush_interval_s=0.01)

    def producer(t: int) -> None:
        for i in range(per_thread):
            store.add(record(t * per_thread + i))

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()  # must drain everything queued


def read_back(url: str) -> list[RequestRecord]:
    store = RecordStore(url)
    try:
        with store.session() as session:
            return list(session.scalars(select(RequestRecord)))
    finally:
        store.close()


def check_round_trip(url: str) -> None:
    fill_and_close(url)
    rows = read_back(url)
    assert len(rows) == 600
    assert sorted(r.request_id for r in rows) == sorted(f"r{i}" for i in range(600))
    by_id = {r.request_id: r for r in rows}
    assert by_id["r41"].prompt_tokens == 41 and by_id["r41"].cached_tokens == 20
    assert all(r.ts is not None for r in rows)


def test_sqlite_close_never_loses_a_record(tmp_path: Path):
    check_round_trip(f"sqlite:///{tmp_path / 'nested' / 'stats.db'}")


def test_flush_makes_records_visible_and_add_never_blocks(tmp_path: Path):
    store = RecordStore(f"sqlite:///{tmp_path / 's.db'}", flush_interval_s=5.0)
    try:
        for i in range(10):
            store.add(record(i))
        assert store.flush(timeout=10)
        assert store.count() == 10
    finally:
        store.close()
    store.add(record(99))  # after close: written synchronously, still not lost
    assert len(read_back(f"sqlite:///{tmp_path / 's.db'}")) == 11


def test_bad_arguments_are_rejected(tmp_path: Path):
    with pytest.raises(ValueError, match="positive"):
        RecordStore(f"sqlite:///{tmp_path / 'x.db'}", batch_size=0)


# ------------------------------------------------------------------------------ PostgreSQL


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_postgres_user(cmd: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; use the Debian package's `postgres` account then.
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """PREFIXGATE_TEST_POSTGRES_URL, or a throwaway cluster started here; skips otherwise."""
    pytest.importorskip("pg8000", reason="the pg8000 driver is not installed")
    url = os.environ.get("PREFIXGATE_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) on this machine")
    root = Path(tempfile.mkdtemp(prefix="prefixgate-pg-"))
    data, port = root / "data", free_port()
    if os.geteuid() == 0:
        shutil.chown(root, user="postgres")
        root.chmod(0o700)
    log = root / "log"
    try:
        subprocess.run(_as_postgres_user([str(bindir / "initdb"), "-D", str(data), "-U",
                                          "postgres", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True, timeout=120)
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
        subprocess.run(_as_postgres_user([str(bindir / "pg_ctl"), "-D", str(data), "-o", options,
                                          "-l", str(log), "-w", "start"]),
                       check=True, capture_output=True, timeout=120)
    except (subprocess.SubprocessError, OSError, KeyError, LookupError) as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"could not start a PostgreSQL server: {exc}")
    try:
        yield f"postgresql+pg8000://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast",
                                          "-w", "stop"]), capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.postgres
def test_postgres_close_never_loses_a_record(postgres_url: str):
    from sqlalchemy import text

    store = RecordStore(postgres_url)
    with store.engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS requests"))
    store.close()
    check_round_trip(postgres_url)


@pytest.mark.postgres
async def test_gateway_records_into_postgres(postgres_url: str, tmp_path: Path):
    backend = FakeBackend()
    app = create_app(fake_config(tmp_path, db_url=postgres_url), backend=backend)
    store: RecordStore = app.state.store
    before = store.count()
    async with asgi_client(app) as http:
        for word in ("one", "two"):
            response = await http.post("/v1/chat/completions", json={
                "model": FAKE_MODEL, "messages": [{"role": "user", "content": word}]})
            assert response.status_code == 200
    store.close()  # what the lifespan does on shutdown
    rows = read_back(postgres_url)
    assert len(rows) == before + 2
    assert {r.request_id for r in backend.seen} <= {r.request_id for r in rows}


def test_a_timestamp_with_an_offset_is_stored_at_its_instant(tmp_path: Path) -> None:
    """SQLite keeps a datetime's fields and drops its offset: a record stamped 11:00+02:00
    (09:00 UTC) was counted as 11:00 UTC, outside a window ending at 09:30 UTC, and one stamped
    10:00+02:00 (08:00 UTC) inside one starting at 08:30."""
    from datetime import UTC, datetime, timedelta, timezone

    from gateway.api_stats import compute_stats

    store = RecordStore(f"sqlite:///{tmp_path / 's.db'}", flush_interval_s=0.02)
    plus2 = timezone(timedelta(hours=2))
    try:
        for hour in (10, 11):
            row = record(hour)
            row.ts = datetime(2026, 3, 9, hour, 0, tzinfo=plus2)
            store.add(row)
        store.flush()
        stats = compute_stats(store.engine, window_s=3600, bucket_s=3600,
                              now=datetime(2026, 3, 9, 9, 30, tzinfo=UTC))
        assert stats["totals"]["requests"] == 1
        assert [p["t"] for p in stats["series"]] == ["2026-03-09T09:00:00+00:00"]
    finally:
        store.close()
