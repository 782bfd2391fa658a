"""What one Python proxy hop costs here, layer by layer: server framework, upstream client, hop.

One client sends the gateway benchmark's ~4k-token agent requests (each once, fresh) to the fake
upstream directly and through four pass-through proxies, side by side (requests rotate over the
servers), and reports each proxy's added p50 / p90 over direct:

- `gateway protocol + transport`: `bare_proxy.py`, uvicorn's server with the gateway's own
  protocol and ASGI in front (as the gateway serves), the gateway's upstream client behind (as
  the gateway sends): the floor row of bench_gateway;
- `uvicorn protocol + transport`: the same with uvicorn's own httptools protocol;
- `raw front + transport`: `raw_proxy.py`, the same client behind an asyncio protocol that
  parses with httptools itself (no uvicorn, no ASGI);
- `raw front + raw client`: `raw_proxy.py raw`, one write and one httptools parse each way.

The first three differ only in the server layer, the last two only in the upstream client.

    python benchmarks/bench_hop.py [--quick] [--out PATH]

Prints a table and writes benchmarks/results/hop.json (--quick: a scratch file, fewer requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gateway import _pct, latency_bodies, table  # noqa: E402
from benchmarks.gateway_servers import (  # noqa: E402
    ROOT,
    _env,
    bare_proxy,
    fake_upstream,
    free_port,
    process,
)

RESULTS = ROOT / "benchmarks" / "results" / "hop.json"
WARM_UP = 10
# row -> (script, its server protocol or upstream client)
PROXIES = {"gateway protocol + transport": ("bare", "gateway"),
           "uvicorn protocol + transport": ("bare", "uvicorn"),
           "raw front + transport": ("raw", "transport"),
           "raw front + raw client": ("raw", "raw")}


@contextlib.contextmanager
def raw_proxy(upstream: str, client: str) -> Iterator[str]:
    """`benchmarks/raw_proxy.py` in front of `upstream`; its base URL."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "raw_proxy.py"), str(port), upstream,
           client]
    with process(cmd, f"http://127.0.0.1:{port}/healthz", _env()):
        yield f"http://127.0.0.1:{port}"


async def rotate(urls: dict[str, str], bodies: list[bytes]) -> dict[str, list[float]]:
    """Each body once to every server, the order rotated per body; ms per request, the
    first `WARM_UP` bodies not counted."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    names = list(urls)
    async with httpx.AsyncClient(timeout=60.0) as client:
        for i, body in enumerate(tqdm(bodies, desc="one client", leave=False)):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start = time.perf_counter()
                response = await client.post(f"{urls[name]}/v1/chat/completions", content=body,
                                             headers={"content-type": "application/json"})
                elapsed = (time.perf_counter() - start) * 1000.0
                if response.status_code != 200:
                    raise RuntimeError(f"{name} answered {response.status_code}")
                if i >= WARM_UP:
                    out[name].append(elapsed)
    return out


def run(n: int) -> dict[str, Any]:
    bodies_json, mean_tokens = latency_bodies(n + WARM_UP)
    bodies = [json.dumps(b).encode() for b in bodies_json]
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(fake_upstream())
        urls = {"direct": up}
        for name, (script, choice) in PROXIES.items():
            urls[name] = stack.enter_context(
                bare_proxy(up, choice) if script == "bare" else raw_proxy(up, choice))
        lat = asyncio.run(rotate(urls, bodies))
    direct = _pct(lat["direct"], 0.5)
    rows = {name: {"p50_ms": round(_pct(v, 0.5), 3), "p90_ms": round(_pct(v, 0.9), 3),
                   "p50_added_ms": round(_pct(v, 0.5) - direct, 3)} for name, v in lat.items()}
    return {"requests": n, "mean_prompt_tokens": round(mean_tokens), "rows": rows,
            "machine": f"{platform.machine()}, {platform.python_version()}"}


def hop_table(res: dict[str, Any]) -> str:
    rows = [[name, f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}", f"{r['p50_added_ms']:+.3f}"]
            for name, r in res["rows"].items()]
    return table(["server (one client)", "p50 ms", "p90 ms", "p50 added ms"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON path ({RESULTS}; --quick: a scratch file in the temp dir)")
    args = parser.parse_args(argv)
    n = args.requests or (40 if args.quick else 300)
    out = args.out or (Path(tempfile.gettempdir()) / "hop-quick.json" if args.quick
                       else RESULTS)
    res = run(n)
    print(f"{n} requests of ~{res['mean_prompt_tokens']} tokens, one client, rotated")
    print(hop_table(res))
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
