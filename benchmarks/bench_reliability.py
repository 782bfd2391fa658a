"""Reliability benchmark: replay issue 17's load and fault scenarios against the gateway.

    python benchmarks/bench_reliability.py [--quick]

The gateway runs under uvicorn in a background thread, proxying to an in-process caching fake
upstream (gateway.fake_upstream); clients are httpx over real sockets. Scenarios: steady load of
many clients, a stats-database outage (SQLite made to fail, and PostgreSQL really stopped and
started when it is installed), poisoned rows among good ones, clients that give up before the
first token, per-tenant overload, a full queue, fuzzed malformed bodies, one 100k-message body
while /healthz is probed, and large distinct prompts (RSS). For each: requests sent, answers by
class, records written, records lost, p50/p99 latency and the process RSS. Targets: 0 records
lost, and no 5xx but the deliberate 503 of a full queue ("shed").

Writes benchmarks/results/reliability.json (a --quick run writes under the temp folder instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from sqlalchemy import event

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.app import create_app  # noqa: E402
from gateway.backends.pool import ReplicaPool  # noqa: E402
from gateway.backends.providers import make_upstream  # noqa: E402
from gateway.backends.upstream_http import UpstreamOptions  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream  # noqa: E402
from gateway.http_server import HttpProtocol  # noqa: E402
from gateway.stats import RecordStore  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "reliability.json"
SCRATCH = Path(tempfile.gettempdir()) / "prefixgate-bench" / "reliability-quick.json"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-c": "tenant-c"}
ADMIN = "bench-admin-key-0123"
SYSTEM = " ".join(f"Policy {i}: answer briefly, cite the order id, never guess." for i in range(40))


@dataclass
class Row:
    """One scenario's figures."""

    scenario: str
    sent: int = 0
    ok: int = 0
    client_4xx: int = 0
    closed_499: int = 0
    shed_503: int = 0
    other_5xx: int = 0
    records: int = 0
    lost: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    rss_mb: float = 0.0
    note: str = ""
    latencies: list[float] = field(default_factory=list, repr=False)

    def count(self, status: int, seconds: float) -> None:
        self.sent += 1
        self.latencies.append(seconds * 1000.0)
        if status < 300:
            self.ok += 1
        elif status == 499:
            self.closed_499 += 1
        elif status == 503:
            self.shed_503 += 1
        elif status >= 500:
            self.other_5xx += 1
        else:
            self.client_4xx += 1

    def finish(self, records: int) -> Row:
        self.records = records
        self.lost = max(0, self.sent - records)
        if self.latencies:
            ordered = sorted(self.latencies)
            self.p50_ms = round(statistics.median(ordered), 1)
            self.p99_ms = round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1)
        self.rss_mb = rss_mb()
        return self


def rss_mb() -> float:
    """This process's resident set size now (MB)."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


# ---------------------------------------------------------------- the gateway under test


class Gateway:
    """The app over one fake caching replica, served by uvicorn on a free port."""

    def __init__(self, db_url: str, upstream: FakeUpstreamConfig | None = None,
                 **config: Any) -> None:
        self.upstream_app = create_fake_upstream(upstream or FakeUpstreamConfig(keep_bodies=False))
        backend = make_upstream("openai", UpstreamOptions(url="http://replica.test/v1",
                                                          name="r0", timeout_s=30.0),
                                transport=httpx.ASGITransport(app=self.upstream_app))
        self.pool = ReplicaPool("openai", [backend])
        values: dict[str, Any] = dict(db_url=db_url, api_keys=KEYS, admin_key=ADMIN,
                                      lint_mode="report", salt_secret="bench-salt-secret-0123",
                                      stats_flush_interval_s=0.05)
        values.update(config)
        self.app = create_app(GatewayConfig(**values), backend=self.pool)
        self.pool.bind_metrics(self.app.state.metrics)
        self.store: RecordStore = self.app.state.store
        with _socket() as port:
            self.url = f"http://127.0.0.1:{port}"
            self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port,
                                                        log_level="error", lifespan="on",
                                                        http=HttpProtocol))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Gateway:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.store.close()

    def records(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while self.store.pending() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.store.flush()
        return self.store.count()


@contextmanager
def _socket() -> Iterator[int]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    yield port


def chat(tenant_turn: int, *, model: str = "fake", stream: bool = False) -> dict[str, Any]:
    return {"model": model, "stream": stream, "max_tokens": 16, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"where is order {tenant_turn}?"}]}


async def post(http: httpx.AsyncClient, row: Row, body: Any, key: str = "key-a", *,
               abandon_after: float | None = None) -> int:
    """POST one chat body; with `abandon_after` the client gives up after that many seconds
    (counted as 499, which is what the gateway records)."""
    started = time.perf_counter()
    kwargs: dict[str, Any] = {} if abandon_after is None else {"timeout": abandon_after}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        r = await http.post("/v1/chat/completions", content=content,
                            headers={"authorization": f"Bearer {key}",
                                     "content-type": "application/json"}, **kwargs)
        status = r.status_code
    except httpx.TimeoutException:
        status = 499 if abandon_after is not None else 599
    except httpx.HTTPError:
        status = 599  # a transport failure counts as a 5xx
    row.count(status, time.perf_counter() - started)
    return status


async def clients(url: str, row: Row, n_clients: int, per_client: int,
                  body_for: Callable[[int, int], Any]) -> None:
    limits = httpx.Limits(max_connections=n_clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def one(c: int) -> None:
            key = ("key-a", "key-b", "key-c")[c % 3]
            for i in range(per_client):
                await post(http, row, body_for(c, i), key)

        await asyncio.gather(*(one(c) for c in range(n_clients)))


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


# ---------------------------------------------------------------- scenarios


def scenario_load(tmp: Path, quick: bool) -> Row:
    n, per = (16, 8) if quick else (64, 20)
    row = Row("load", note=f"{n} clients x {per} requests, 3 tenants")
    with Gateway(f"sqlite:///{tmp / 'load.db'}") as gw:
        run(clients(gw.url, row, n, per, lambda c, i: chat(c * 1000 + i, stream=bool(i % 2))))
        return row.finish(gw.records())


class Outage:
    """Every statement on the store's engine fails while `down`."""

    def __init__(self, store: RecordStore) -> None:
        self.down = False
        event.listen(store.engine, "before_cursor_execute", self._hook)

    def _hook(self, *_: Any) -> None:
        if self.down:
            raise sqlite3.OperationalError("database is locked")


def scenario_sqlite_outage(tmp: Path, quick: bool) -> Row:
    n, per, down_s = (8, 20, 2.0) if quick else (32, 40, 10.0)
    row = Row("db_outage_sqlite", note=f"database failing for {down_s:g} s mid-load")
    with Gateway(f"sqlite:///{tmp / 'outage.db'}") as gw:
        outage = Outage(gw.store)

        async def flip() -> None:
            await asyncio.sleep(0.5)
            outage.down = True
            await asyncio.sleep(down_s)
            outage.down = False

        async def both() -> None:
            await asyncio.gather(flip(), clients(gw.url, row, n, per, lambda c, i: chat(i)))

        run(both())
        row.note += f"; spilled {gw.store.spilled}"
        return row.finish(gw.records())


def scenario_postgres_outage(tmp: Path, quick: bool) -> Row | None:
    try:
        from tests.gateway.pg_cluster import PgCluster, pg_bin
    except ImportError:
        return None
    bindir = pg_bin()
    if bindir is None:
        return None
    cluster = PgCluster.start_new(bindir)
    n, per, down_s = (8, 20, 3.0) if quick else (32, 40, 15.0)
    row = Row("db_outage_postgres", note=f"PostgreSQL stopped {down_s:g} s mid-load")
    try:
        with Gateway(cluster.new_database(), stats_spill_path=str(tmp / "pg.spill")) as gw:
            async def flip() -> None:
                await asyncio.sleep(0.5)
                await asyncio.to_thread(cluster.stop)
                await asyncio.sleep(down_s)
                await asyncio.to_thread(cluster.start)

            async def both() -> None:
                await asyncio.gather(flip(), clients(gw.url, row, n, per, lambda c, i: chat(i)))

            run(both())
            row.note += f"; spilled {gw.store.spilled}"
            return row.finish(gw.records())
    finally:
        cluster.destroy()


POISON_MODELS = ["bad\u0000model", "lone \ud800 surrogate", "m" * 300]


def scenario_poisoned(tmp: Path, quick: bool) -> Row:
    n, per = (8, 10) if quick else (32, 20)
    row = Row("poisoned_rows", note="1 in 8 requests with a NUL / lone surrogate / 300-char model")

    def body(c: int, i: int) -> Any:
        if (c + i) % 8:
            return chat(i)
        raw = json.dumps(chat(i, model=POISON_MODELS[(c + i) % 3]))  # \ud800 stays escaped
        return raw.encode()

    with Gateway(f"sqlite:///{tmp / 'poison.db'}") as gw:
        run(clients(gw.url, row, n, per, body))
        return row.finish(gw.records())


def scenario_abandoned(tmp: Path, quick: bool) -> Row:
    n = 10 if quick else 30
    row = Row("abandoned", note=f"{n} clients give up before the first token; then one more")
    upstream = FakeUpstreamConfig(keep_bodies=False, prefill_us_per_token=2000.0,
                                  serial_prefill=True)  # ~1 s of prefill each, one at a time
    with Gateway(f"sqlite:///{tmp / 'abandon.db'}", upstream) as gw:
        async def go() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=120) as http:
                for i in range(n):
                    await post(http, row, chat(10_000 + i), abandon_after=0.05)
                await asyncio.sleep(0.5)
                await post(http, row, chat(1))  # served without waiting behind the others

        run(go())
        row.note += f"; last request {row.latencies[-1]:.0f} ms"
        return row.finish(gw.records())


def scenario_overload(tmp: Path, quick: bool) -> Row:
    burst = 20 if quick else 100
    row = Row("tenant_overload", note=f"tenant a: {burst} at once (limit 5/s, 4 in flight); "
                                      "tenant b: 5")
    with Gateway(f"sqlite:///{tmp / 'over.db'}", tenant_rate_per_s=5.0, tenant_burst=5,
                 tenant_max_concurrency=4) as gw:
        async def go() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=120) as http:
                jobs = [post(http, row, chat(i), "key-a") for i in range(burst)]
                jobs += [post(http, row, chat(i), "key-b") for i in range(5)]
                await asyncio.gather(*jobs)

        run(go())
        return row.finish(gw.records())


def scenario_queue_full(tmp: Path, quick: bool) -> Row:
    n = 40 if quick else 200
    row = Row("queue_full", note=f"{n} at once, 4 slots + 8 queued (503 sheds the rest)")
    upstream = FakeUpstreamConfig(keep_bodies=False, delay_s=0.2)
    with Gateway(f"sqlite:///{tmp / 'queue.db'}", upstream, max_concurrency=4,
                 max_queue=8) as gw:
        async def go() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=120,
                                         limits=httpx.Limits(max_connections=n + 4)) as http:
                await asyncio.gather(*(post(http, row, chat(i), ("key-a", "key-b")[i % 2])
                                       for i in range(n)))

        run(go())
        return row.finish(gw.records())


def fuzzed_bodies(n: int, seed: int = 17) -> list[bytes]:
    """Malformed or hostile bodies: deep nesting, huge numbers, wrong types, broken bytes."""
    rng = random.Random(seed)
    good = json.dumps(chat(1)).encode()
    makers: list[Callable[[], bytes]] = [
        lambda: b'{"model":"fake","x":' + b"[" * rng.randint(65, 20_000) + b"]" * 20_000 + b"}",
        lambda: b'{"model":"fake","max_tokens":' + b"9" * rng.randint(20, 6000) + b"}",
        lambda: b'{"model":"fake","temperature":1e' + str(rng.randint(309, 9999)).encode() + b"}",
        lambda: good[: rng.randint(1, len(good) - 1)],
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))),
        lambda: json.dumps({**chat(1), "messages": rng.choice([None, 3, "x", [1], [{}]])}
                           ).encode(),
        lambda: json.dumps({**chat(1), "max_tokens": rng.choice([-1, "10", 1.5, None, []])}
                           ).encode(),
        lambda: json.dumps([chat(1)]).encode(),
        lambda: b'{"model":"fake","messages":[{"role":"user","content":"\\ud800"}],"top_p":NaN}',
    ]
    return [rng.choice(makers)() for _ in range(n)]


def scenario_malformed(tmp: Path, quick: bool) -> Row:
    row = Row("malformed", note="300 fuzzed bodies (deep JSON, huge ints, NaN, truncation, ...)")
    with Gateway(f"sqlite:///{tmp / 'fuzz.db'}") as gw:
        async def go() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=120) as http:
                for body in fuzzed_bodies(300):
                    await post(http, row, body)

        run(go())
        return row.finish(gw.records())


def scenario_big_body(tmp: Path, quick: bool) -> Row:
    n = 30_000 if quick else 100_000
    row = Row("big_body_healthz", note=f"one {n:,}-message body; p50/p99 are /healthz's")
    messages = [{"role": ("user", "assistant")[i % 2], "content": chr(97 + i % 26)}
                for i in range(n)]
    raw = json.dumps({"model": "fake", "max_tokens": 4, "messages": messages}).encode()
    upstream = FakeUpstreamConfig(keep_bodies=False, cache=False)
    with Gateway(f"sqlite:///{tmp / 'big.db'}", upstream, max_body_bytes=8 << 20,
                 lint_max_messages=200_000) as gw:
        async def go() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=600) as http:
                big = asyncio.ensure_future(http.post(
                    "/v1/chat/completions", content=raw,
                    headers={"authorization": "Bearer key-a",
                             "content-type": "application/json"}))
                probes: list[float] = []
                while not big.done():
                    started = time.perf_counter()
                    await http.get("/healthz")
                    probes.append(time.perf_counter() - started)
                    await asyncio.sleep(0.05)
                status = (await big).status_code
                row.sent, row.ok = 1, int(status == 200)
                row.other_5xx = int(status >= 500)
                row.latencies = [p * 1000 for p in probes]
                row.note += f"; {len(probes)} probes, max {max(probes) * 1000:.0f} ms"

        run(go())
        return row.finish(gw.records())


def scenario_large_prompts(tmp: Path, quick: bool) -> Row:
    n = LARGE_PROMPTS[0] or (8 if quick else 60)
    before = rss_mb()
    row = Row("large_prompts", note=f"{n} distinct ~0.9 MB system prompts (lint on); "
                                    f"RSS before {before} MB")
    every = max(n // 6, 1)
    trail: list[str] = []
    rng = random.Random(3)
    words = [f"w{i}" for i in range(8000)]
    base = " ".join(rng.choice(words) for _ in range(150_000))
    upstream = FakeUpstreamConfig(keep_bodies=False, cache=False)  # its cache is not ours
    with Gateway(f"sqlite:///{tmp / 'large.db'}", upstream, max_body_bytes=4 << 20) as gw:
        async def go() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=300) as http:
                for i in range(n):
                    body = {"model": "fake", "max_tokens": 4, "messages": [
                        {"role": "system", "content": f"prompt {i} {base}"},
                        {"role": "user", "content": "hi"}]}
                    await post(http, row, body)
                    if (i + 1) % every == 0:
                        trail.append(f"{i + 1}: {rss_mb():.0f}")

        run(go())
        row.note += f"; RSS MB after prompts {', '.join(trail)}"
        return row.finish(gw.records())


#: prompts of the large_prompts scenario (0: 60, or 8 with --quick); set by --prompts
LARGE_PROMPTS = [0]

SCENARIOS: list[Callable[[Path, bool], Row | None]] = [
    scenario_load, scenario_sqlite_outage, scenario_postgres_outage, scenario_poisoned,
    scenario_abandoned, scenario_overload, scenario_queue_full, scenario_malformed,
    scenario_big_body, scenario_large_prompts,
]


def table(rows: list[Row]) -> str:
    header = ("scenario", "sent", "2xx", "4xx", "499", "503 shed", "5xx", "records", "lost",
              "p50 ms", "p99 ms", "RSS MB")
    lines = [header] + [(r.scenario, r.sent, r.ok, r.client_4xx, r.closed_499, r.shed_503,
                         r.other_5xx, r.records, r.lost, r.p50_ms, r.p99_ms, r.rss_mb)
                        for r in rows]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["  ".join(str(v).rjust(w) if i else str(v).ljust(w)
                     for i, (v, w) in enumerate(zip(line, widths, strict=True)))
           for line in lines]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (scratch output)")
    parser.add_argument("--only", nargs="*", help="scenario names to run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=0,
                        help="prompts in the large_prompts scenario (default 60; 8 with --quick)")
    args = parser.parse_args(argv)
    LARGE_PROMPTS[0] = args.prompts
    out = args.out or (SCRATCH if args.quick else RESULTS)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="prefixgate-rel-") as folder:
        for scenario in SCENARIOS:
            name = scenario.__name__.removeprefix("scenario_")
            if args.only and name not in args.only:
                continue
            print(f"running {name} ...", flush=True)
            row = scenario(Path(folder), args.quick)
            if row is not None:
                rows.append(row)
                print(f"  {row.scenario}: sent {row.sent}, lost {row.lost}, "
                      f"5xx {row.other_5xx} ({row.note})", flush=True)
    print("\nReliability (" + ("quick" if args.quick else "full") + f" run, load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):")
    print(table(rows))
    for row in rows:
        print(f"  {row.scenario}: {row.note}")
    lost = sum(r.lost for r in rows)
    errors = sum(r.other_5xx for r in rows)
    print(f"targets: records lost {lost} (0), 5xx other than shed {errors} (0)")
    result = {"quick": args.quick, "python": platform.python_version(), "cpus": os.cpu_count(),
              "load": os.getloadavg()[0],
              "rows": [{k: v for k, v in asdict(r).items() if k != "latencies"} for r in rows],
              "targets": {"lost": lost, "other_5xx": errors}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if lost == 0 and errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
