"""Profile the gateway's request path: where the CPU of a 4k-token request goes.

In-process (default): the gateway app (upstream mode, lint in report mode) in front of the fake
upstream (no caching, answers at once), both driven over ASGI transports in one process and one
client, so the profile holds only the gateway's own work (plus the fake's, shown apart). Prints
cProfile's top entries by cumulative and by own time, and CPU ms per request with lint on and
off.

--server: the real thing, as bench_gateway runs it: `prefixgate serve` in its own process in
front of the fake upstream's process, one client sending bench_gateway's requests over TCP,
py-spy (`pip install py-spy`) sampling whichever gateway thread holds the GIL (a thread waiting
for the GIL or in a lock counts as idle, so the samples are Python's CPU; tiktoken's encoder
runs without the GIL and is under-counted). Prints the gateway's CPU ms per request (from
/proc, kernel time included, over a pass without the profiler: py-spy's sampling costs the
process CPU of its own) split into the request path's parts in proportion to the samples
(benchmarks/spy_profile.py), and the busiest frames; writes the table to --out (default
benchmarks/results/profile_gateway.txt).

    python benchmarks/profile_gateway.py [--requests 200] [--lint report|off] [--top 30]
    python benchmarks/profile_gateway.py --server [--requests 400] [--lint report|off]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import latency_bodies, table  # noqa: E402
from benchmarks.gateway_servers import cpu_ms, fake_upstream, gateway_server  # noqa: E402
from benchmarks.spy_profile import busy_stacks, shares, top_leaves  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.backends.pool import ReplicaPool  # noqa: E402
from gateway.backends.providers import make_upstream  # noqa: E402
from gateway.backends.upstream_http import UpstreamOptions  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.fake_upstream import FakeUpstreamConfig, create_fake_upstream  # noqa: E402


async def drive(bodies: list[bytes], lint: str, tmp: Path,
                profile: cProfile.Profile | None) -> float:
    """Send every body through the gateway once (after a warm-up); CPU ms per request."""
    fake = create_fake_upstream(FakeUpstreamConfig(cache=False, keep_bodies=False))
    upstream = make_upstream("openai", UpstreamOptions(url="http://up.bench/v1"),
                             transport=httpx.ASGITransport(app=fake))
    app = create_app(GatewayConfig(db_url=f"sqlite:///{tmp / f'{lint}.db'}", lint_mode="report"),
                     backend=ReplicaPool("openai", [upstream]))
    headers = {"content-type": "application/json", "x-prefixgate-lint-mode": lint}
    url = "http://gw.bench/v1/chat/completions"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        for body in bodies[:10]:
            (await client.post(url, content=body, headers=headers)).raise_for_status()
        app.state.store.flush()
        start = time.process_time()
        if profile:
            profile.enable()
        for body in bodies:
            (await client.post(url, content=body, headers=headers)).raise_for_status()
        app.state.store.flush()
        if profile:
            profile.disable()
        cpu = (time.process_time() - start) * 1000.0 / len(bodies)
    app.state.store.close()
    await upstream.aclose()
    return cpu


SERVER_RESULTS = ROOT / "benchmarks" / "results" / "profile_gateway.txt"
SPY_RATE_HZ = 500


async def send_all(url: str, bodies: list[bytes], headers: dict[str, str]) -> None:
    """Each body once, one at a time (bench_gateway's one-client loop)."""
    async with httpx.AsyncClient(timeout=60.0) as client:
        for body in bodies:
            (await client.post(url, content=body, headers=headers)).raise_for_status()


def profile_server(bodies: list[bytes], lint: str, top: int) -> str:
    """The gateway server's CPU per request, split by part of the request path (a report)."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--server needs py-spy on PATH (pip install py-spy)")
    headers = {"content-type": "application/json", "x-prefixgate-lint-mode": lint}
    with tempfile.TemporaryDirectory() as tmp, fake_upstream() as up, \
            gateway_server(up, Path(tmp) / "p.db") as gw:
        url = f"{gw.url}/v1/chat/completions"
        asyncio.run(send_all(url, bodies[:20], headers))  # warm: caches, connections
        start = cpu_ms(gw.pid)  # unprofiled: py-spy's sampling costs the process CPU too
        asyncio.run(send_all(url, bodies, headers))
        per_request = (cpu_ms(gw.pid) - start) / len(bodies)
        raw = Path(tmp) / "spy.txt"
        cmd = [spy, "record", "--pid", str(gw.pid), "--rate", str(SPY_RATE_HZ), "--threads",
               "--format", "raw", "--output", str(raw), "--gil"]
        recorder = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
        asyncio.run(send_all(url, bodies, headers))
        recorder.send_signal(2)  # SIGINT: py-spy writes its file and exits
        recorder.wait(60)
        stacks = busy_stacks(raw.read_text().splitlines())
    rows = [[s.category, f"{100 * s.fraction:.1f}%", f"{s.ms_per_request:.2f}"]
            for s in shares(stacks, per_request)]
    leaves = [[frame[:90], f"{100 * f:.1f}%"] for frame, f in top_leaves(stacks, top)]
    load = os.getloadavg()
    return "\n".join([
        f"gateway server, lint {lint}: {per_request:.2f} CPU ms per request (a pass without the "
        f"profiler), split by the py-spy --gil samples of a second pass "
        f"({len(bodies)} requests of ~4k tokens, one client; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs)",
        table(["part of the request path", "busy samples", "CPU ms/request"], rows), "",
        table(["busiest frames (own samples)", "share"], leaves)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="(--server: 400 is steadier)")
    parser.add_argument("--lint", default="report", choices=("report", "off"))
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-profile", action="store_true", help="CPU ms per request only")
    parser.add_argument("--server", action="store_true",
                        help="sample the real gateway server with py-spy (see above)")
    parser.add_argument("--out", type=Path, default=SERVER_RESULTS,
                        help="where --server writes its table")
    args = parser.parse_args(argv)
    bodies = [json.dumps(b).encode() for b in latency_bodies(args.requests)[0]]
    if args.server:
        report = profile_server(bodies, args.lint, min(args.top, 20))
        print(report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")
        print(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.no_profile:
            for lint in ("report", "off"):
                cpu = asyncio.run(drive(bodies, lint, Path(tmp), None))
                print(f"lint {lint}: {cpu:.2f} CPU ms per request (client + gateway + fake)")
            return 0
        profile = cProfile.Profile()
        cpu = asyncio.run(drive(bodies, args.lint, Path(tmp), profile))
    print(f"lint {args.lint}: {cpu:.2f} CPU ms per request under the profiler")
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
