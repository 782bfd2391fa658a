"""/api/stats on a busy gateway's database: raw rows vs per-minute/hour/day rollups, and what the
stats writer costs.

    python benchmarks/bench_stats.py [--quick] [--rows N] [--days D] [--no-postgres]

Bulk-loads N request records (default 1,000,000; --quick 100,000) spread over the D days
(default 30) before now, with a skewed mix of tenants, models, replicas, families, statuses and lint
findings, as a database an older gateway wrote (raw rows, no rollups); times building the
rollups from them (catching up from watermark 0: what opening such a database does once); then
times `compute_stats` over 1 h / 24 h / 7 d / 30 d windows reading raw rows (`source="raw"`,
what /api/stats did before rollups) and reading rollups (`source="rollup"`, its catch-up
included), and checks that both answer the same. The stats writer's throughput (rows/s from
`RecordStore.add` to commit) and its thread's CPU time per row are measured on a fresh
database (SQLite 100,000 rows, PostgreSQL 20,000; a fifth of that with --quick); the writer
does no rollup work, so these are what it costs without rollups too. SQLite, and PostgreSQL
when its server binaries are installed (a throwaway cluster, loaded with COPY). Two threads at
most: this one and the stats writer.

Writes benchmarks/results/stats.json (a --quick run writes nowhere under results/).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.api_stats import compute_stats  # noqa: E402
from gateway.rollups import ensure_rollups  # noqa: E402
from gateway.stats import _INSERT, RECORD_COLUMNS, RecordStore, _row, make_engine  # noqa: E402
from gateway.stats_tables import Base, RequestRollup  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "stats.json"
WINDOWS = (("1 h", 3600), ("24 h", 86400), ("7 d", 7 * 86400), ("30 d", 30 * 86400))
THROUGHPUT_ROWS = {"sqlite": 100_000, "postgresql": 20_000}
BULK_CHUNK = 20_000
MODELS = (("gpt-4o", 30), ("gpt-4o-mini", 25), ("claude-sonnet-4", 20), ("claude-3-5-haiku", 10),
          ("gpt-4.1", 10), ("local-model", 5))
STATUSES = ((200, 930), (400, 20), (429, 20), (499, 10), (500, 10), (502, 10))
LINTS = (("", 70), ("PL001", 10), ("PL001,PL004", 8), ("PL004", 5), ("PL009", 4),
         ("PL002,PL007", 3))


def _pick(rng: random.Random, weighted: tuple[tuple[Any, int], ...]) -> Any:
    return rng.choices([v for v, _ in weighted], [w for _, w in weighted])[0]


def _agents(rng: random.Random) -> list[tuple[tuple[str, str, str | None], int]]:
    """(tenant, model, family) of each tenant's agents, weighted: 20 tenants by Zipf's law,
    each running one to three agents (a prompt family, or none) on one model apiece."""
    agents = []
    for k in range(1, 21):
        for a in range(rng.randrange(1, 4)):
            family = None if a == 0 and k % 3 == 0 else f"family-{k:02d}-{a}"
            agents.append(((f"tenant-{k:02d}", _pick(rng, MODELS), family), 1000 // k))
    return agents


def make_rows(n: int, now: datetime, days: int = 30, seed: int = 7,
              ) -> Iterator[dict[str, Any]]:
    """N records over the `days` before `now` from the tenants' agents (`_agents`), sent to four
    upstream replicas (one in twenty to the embedded engine, no replica), mostly 200s."""
    rng = random.Random(seed)
    agents = _agents(rng)
    span_s = days * 86400
    for i in range(n):
        tenant, model, family = _pick(rng, agents)
        engine = rng.random() < 0.05
        prompt = rng.randrange(200, 12000)
        cached = rng.randrange(0, prompt)
        predicted = None if engine else rng.randrange(0, prompt)
        status = _pick(rng, STATUSES)
        yield dict(
            ts=now - timedelta(seconds=rng.uniform(0, span_s)), request_id=f"b{i}",
            tenant=tenant, model="local-model" if engine else model,
            backend="engine" if engine else "upstream",
            replica=None if engine else f"http://replica-{rng.randrange(4)}:8000",
            provider="openai", route="chat.completions", status=status, prompt_tokens=prompt,
            cached_tokens=cached, completion_tokens=rng.randrange(1, 800),
            predicted_cached_tokens=predicted,
            reported_cached_tokens=None if engine or status >= 400 else cached,
            latency_ms=rng.uniform(50, 9000), prefill_saved_ms=rng.uniform(0, 400),
            lint_ids=_pick(rng, LINTS), family=family)


def load(store: RecordStore, n: int, now: datetime, label: str) -> tuple[float, float]:
    """Add N rows through the writer as fast as it commits them; rows per second, and the
    writer thread's CPU microseconds per row."""
    clock = time.pthread_getcpuclockid(store._thread.ident or 0)
    cpu = time.clock_gettime(clock)
    start = time.perf_counter()
    with tqdm(total=n, desc=label, unit="row", leave=False, mininterval=0.5) as bar:
        for i, row in enumerate(make_rows(n, now)):
            store.add(row)
            if i % 2048 == 2047:
                bar.update(2048)
                while store.pending() > 6000:  # stay under the queue's bound (no spill)
                    time.sleep(0.002)
        assert store.flush(timeout=None)
        bar.update(n - bar.n)
    wall = time.perf_counter() - start
    cpu = time.clock_gettime(clock) - cpu
    assert store.spilled == 0 and store.lost == 0
    return n / wall, cpu / n * 1e6


def _same(a: Any, b: Any) -> bool:
    """Equal answers (floats up to the order SQL added them in)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    return bool(a == b)


def _timed(engine: Any, window_s: int, now: datetime, source: str) -> tuple[float, Any]:
    start = time.perf_counter()
    stats = compute_stats(engine, window_s=window_s, now=now, source=source)
    return time.perf_counter() - start, stats


def _csv_field(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, str):
        return '"' + value.replace('"', '""') + '"'
    if isinstance(value, datetime):
        return value.isoformat()
    return repr(value)


def bulk_load(engine: Any, n: int, days: int, now: datetime, label: str) -> None:
    """N raw rows, as fast as the database takes them (executemany; COPY on PostgreSQL)."""
    Base.metadata.tables["requests"].create(engine)
    insert_rows(engine, make_rows(n, now, days), n, label)


def insert_rows(engine: Any, rows: Iterator[dict[str, Any]], n: int, label: str) -> None:
    """N rows from `rows` into `requests`, BULK_CHUNK per transaction."""
    columns = sorted(RECORD_COLUMNS)
    with tqdm(total=n, desc=label, unit="row", leave=False, mininterval=0.5) as bar:
        while bar.n < n:
            chunk = [_row(next(rows)) for _ in range(min(BULK_CHUNK, n - bar.n))]
            with engine.begin() as conn:
                if engine.dialect.name == "postgresql":
                    text = "".join(",".join(_csv_field(r[c]) for c in columns) + "\n"
                                   for r in chunk)
                    cursor = conn.connection.dbapi_connection.cursor()
                    cursor.execute(f"COPY requests ({', '.join(columns)}) FROM STDIN "
                                   "WITH (FORMAT csv)", stream=io.BytesIO(text.encode()))
                else:
                    conn.execute(_INSERT, chunk)
            bar.update(len(chunk))


def bench_database(name: str, url: str, scratch_url: str, n: int, days: int,
                   now: datetime, throughput_rows: int) -> dict[str, Any]:
    """Bulk-load, build the rollups, query both ways; writer throughput on a scratch
    database."""
    out: dict[str, Any] = {"database": name, "rows": n}
    # no pg8000 socket timeout: a raw 30-day query on PostgreSQL may run longer than the
    # writer's 10 s
    engine = make_engine(url) if name == "sqlite" else create_engine(url)
    try:
        bulk_load(engine, n, days, now, f"{name}: load {n:,} rows")
        Base.metadata.create_all(engine)
        start = time.perf_counter()
        ensure_rollups(engine)
        out["build_rollups_s"] = round(time.perf_counter() - start, 2)
        with engine.connect() as conn:
            out["rollup_rows"] = int(conn.scalar(select(func.count()).select_from(RequestRollup))
                                     or 0)
        out["windows"] = []
        for label, window_s in tqdm(WINDOWS, desc=f"{name}: queries", leave=False):
            raw_s, raw = _timed(engine, window_s, now, "raw")
            rollup_s, rolled = _timed(engine, window_s, now, "rollup")
            out["windows"].append({"window": label, "raw_s": round(raw_s, 4),
                                   "rollup_s": round(rollup_s, 4),
                                   "requests": raw["totals"]["requests"],
                                   "same_answer": _same(raw, rolled)})
        out.update(_day_later(engine, n // days, now, name))
    finally:
        engine.dispose()
    writer = RecordStore(scratch_url)
    try:
        rate, cpu = load(writer, throughput_rows, now, f"{name}: writer")
        out["insert_rows_per_s"], out["writer_cpu_us_per_row"] = round(rate), round(cpu, 1)
    finally:
        writer.close()
    out["throughput_rows"] = throughput_rows
    return out


def _day_later(engine: Any, n: int, now: datetime, name: str) -> dict[str, Any]:
    """A day's rows written after the last read, in time order as a gateway writes them:
    the 30-day rollup read that catches them up, and the one after it."""
    later = now + timedelta(days=1)
    day = iter(sorted(make_rows(n, later, 1, seed=8), key=lambda r: r["ts"]))
    insert_rows(engine, day, n, f"{name}: a day later")
    first_s, _ = _timed(engine, 30 * 86400, later, "rollup")
    again_s, _ = _timed(engine, 30 * 86400, later, "rollup")
    return {"day_rows": n, "rollup_30d_catching_up_a_day_s": round(first_s, 4),
            "rollup_30d_after_s": round(again_s, 4)}


@contextmanager
def postgres() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster, or None when it is not installed."""
    try:
        from tests.gateway.pg_cluster import PgCluster, pg_bin
    except ImportError:
        yield None
        return
    bindir = pg_bin()
    if bindir is None:
        yield None
        return
    cluster = PgCluster.start_new(bindir)
    try:
        yield cluster
    finally:
        cluster.destroy()


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'database':<10} {'window':>6} {'requests':>9} {'raw s':>8} {'rollup s':>9} "
          f"{'speed-up':>8} {'same':>5}")
    for db in results:
        for w in db["windows"]:
            speed = w["raw_s"] / w["rollup_s"] if w["rollup_s"] else float("inf")
            print(f"{db['database']:<10} {w['window']:>6} {w['requests']:>9,} {w['raw_s']:>8.3f} "
                  f"{w['rollup_s']:>9.3f} {speed:>7.1f}x {str(w['same_answer']):>5}")
    print(f"\n{'database':<10} {'rows':>10} {'rollup rows':>11} {'build s':>8}   "
          f"writer: {'rows/s':>7} {'CPU us/row':>10} (of {'rows':>7})")
    for db in results:
        print(f"{db['database']:<10} {db['rows']:>10,} {db['rollup_rows']:>11,} "
              f"{db['build_rollups_s']:>8.1f}   {'':>7} {db['insert_rows_per_s']:>7,} "
              f"{db['writer_cpu_us_per_row']:>10} (of {db['throughput_rows']:>7,})")
    print()
    for db in results:
        print(f"{db['database']:<10} 30 d read catching up a day ({db['day_rows']:,} rows): "
              f"{db['rollup_30d_catching_up_a_day_s']:.3f} s, the next read "
              f"{db['rollup_30d_after_s']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k rows; write no results")
    parser.add_argument("--rows", type=int, default=None, help="records to load")
    parser.add_argument("--days", type=int, default=30, help="days the records spread over")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    args = parser.parse_args(argv)
    n = args.rows or (100_000 if args.quick else 1_000_000)

    def throughput(database: str) -> int:
        return THROUGHPUT_ROWS[database] // (5 if args.quick else 1)

    now = datetime.now(UTC)
    results = []
    with tempfile.TemporaryDirectory(prefix="prefixgate-bench-stats-") as tmp:
        sqlite = [f"sqlite:///{tmp}/{name}.db" for name in ("stats", "writer")]
        results.append(bench_database("sqlite", sqlite[0], sqlite[1], n, args.days, now,
                                      throughput("sqlite")))
        if not args.no_postgres:
            with postgres() as cluster:
                if cluster is not None:
                    urls = [cluster.new_database() for _ in range(2)]
                    results.append(bench_database("postgresql", urls[0], urls[1],
                                                  n, args.days, now, throughput("postgresql")))
    print_table(results)
    report = {"benchmark": "stats", "rows": n, "spread_days": args.days,
              "machine": {"python": platform.python_version(), "cpu": platform.processor()
                          or platform.machine()},
              "databases": results}
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
