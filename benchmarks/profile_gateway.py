"""Profile the gateway's request path in-process: where the CPU of a 4k-token request goes.

The gateway app (upstream mode, lint in report mode) in front of the fake upstream (no caching,
answers at once), both driven over ASGI transports in one process and one client, so the profile
holds only the gateway's own work (plus the fake's, shown apart). Prints cProfile's top entries
by cumulative and by own time, and CPU ms per request with lint on and off.

    python benchmarks/profile_gateway.py [--requests 200] [--lint report|off] [--top 30]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import latency_bodies  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.backends.pool import ReplicaPool, make_upstream  # noqa: E402
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--lint", default="report", choices=("report", "off"))
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-profile", action="store_true", help="CPU ms per request only")
    args = parser.parse_args(argv)
    bodies = [json.dumps(b).encode() for b in latency_bodies(args.requests)[0]]
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
