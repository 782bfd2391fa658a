"""Two builds of the gateway side by side: how much latency does B add per request beyond A?

    git worktree add --detach /tmp/base <commit>
    python benchmarks/bench_pair.py /tmp/base . [--rounds 4] [--requests 1000] [--quick]

Each round serves both builds at once (upstream mode, lint report, as bench_gateway's
gateway row) over one fake upstream, and sends each of the benchmark's ~4k-token agent requests
(fresh every round: a repeated request finds every memo warm) to the upstream directly and
through both gateways, the order rotated per request. This VM's speed swings by more than the
differences measured, so only side-by-side figures compare. Every round runs twice, each build
listed first once: the first is started first and, in the rotation, asked right after the
upstream two times in three, the other right after it two times in three (while it still does
its bookkeeping); on the same code the first measured 0.03-0.05 ms faster. B - A is reported
per run and as the mean of each pair of runs, which cancels that bias.

Prints a table and writes benchmarks/results/pair.json (--quick: a scratch file, fewer
requests, one round).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gateway import _pct, _timed, latency_bodies, table  # noqa: E402
from benchmarks.gateway_servers import ROOT, fake_upstream, gateway_server  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pair.json"
WARM_UP = 10  # requests per server before the measured ones


class Run(NamedTuple):
    """One run: which build was started first, the p50s, and each build's p50 added."""

    first: str
    direct_p50_ms: float
    added_ms: dict[str, float]

    @property
    def b_minus_a(self) -> float:
        return self.added_ms["B"] - self.added_ms["A"]


def revision(root: Path) -> str:
    """The commit a source tree is at (and `+changes` when it has uncommitted ones)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=False).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "?"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


async def _measure(urls: dict[str, str], bodies: list[bytes]) -> dict[str, list[float]]:
    """Each body once per server, the servers rotated per request; the warm-up unmeasured."""
    modes = list(urls)
    out: dict[str, list[float]] = {m: [] for m in modes}
    async with httpx.AsyncClient(timeout=60.0) as client:
        for i, body in enumerate(tqdm(bodies, desc="pair", leave=False)):
            for k in range(len(modes)):
                mode = modes[(i + k) % len(modes)]
                path = "/v1/chat/completions"
                elapsed = await _timed(client, urls[mode] + path, {}, body)
                if i >= WARM_UP:
                    out[mode].append(elapsed)
    return out


def one_run(roots: dict[str, Path], first: str, bodies: list[bytes], tmp: Path) -> Run:
    """Both builds served at once over one fake upstream, `first` started (and asked) first."""
    order = [first, *(name for name in roots if name != first)]
    with fake_upstream() as upstream, contextlib.ExitStack() as stack:
        urls = {"direct": upstream}
        for name in order:
            db = tmp / f"{name}-{first}.db"
            urls[name] = stack.enter_context(gateway_server(upstream, db, root=roots[name])).url
        lat = asyncio.run(_measure(urls, bodies))
    direct = _pct(lat["direct"], 0.5)
    return Run(first, direct, {name: _pct(lat[name], 0.5) - direct for name in roots})


def run(roots: dict[str, Path], rounds: int, requests: int) -> dict[str, Any]:
    bodies, tokens = latency_bodies(requests * rounds + WARM_UP)
    raw = [json.dumps(b).encode() for b in bodies]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-pair-") as tmp:
        for r in range(rounds):
            fresh = raw[:WARM_UP] + raw[WARM_UP + r * requests:WARM_UP + (r + 1) * requests]
            runs += [one_run(roots, first, fresh, Path(tmp)) for first in ("A", "B")]
    return {"builds": {name: {"root": str(root), "revision": revision(root)}
                       for name, root in roots.items()},
            "requests_per_run": requests, "mean_prompt_tokens": round(tokens),
            "runs": [{**run._asdict(), "b_minus_a_ms": run.b_minus_a} for run in runs],
            **summarise(runs)}


def summarise(runs: list[Run]) -> dict[str, Any]:
    """Runs in pairs (A started first, then B): B - A per pair, its mean, and how much the
    first-started build gained (half the difference between the two orders)."""
    pairs = list(zip(runs[::2], runs[1::2], strict=True))
    per_round = [(a_first.b_minus_a + b_first.b_minus_a) / 2 for a_first, b_first in pairs]
    advantage = [(a_first.b_minus_a - b_first.b_minus_a) / 2 for a_first, b_first in pairs]
    return {"b_minus_a_per_round_ms": per_round,
            "b_minus_a_mean_ms": statistics.mean(per_round),
            "first_started_advantage_ms": statistics.mean(advantage)}


def pair_table(res: dict[str, Any]) -> str:
    rows = []
    for i, r in enumerate(res["runs"]):
        rows.append([str(i // 2 + 1), r["first"], f"{r['direct_p50_ms']:.3f}",
                     f"{r['added_ms']['A']:+.3f}", f"{r['added_ms']['B']:+.3f}",
                     f"{r['b_minus_a_ms']:+.3f}",
                     f"{res['b_minus_a_per_round_ms'][i // 2]:+.3f}" if i % 2 else ""])
    return table(["round", "first", "direct p50", "A added", "B added", "B-A", "round B-A"],
                 rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="source tree of build A (the reference)")
    parser.add_argument("b", type=Path, help="source tree of build B")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (4; --quick 1)")
    parser.add_argument("--requests", type=int, default=None,
                        help="per run (1000; --quick 40)")
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON path ({RESULTS}; --quick: a scratch file in the temp dir)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 4)
    requests = args.requests or (40 if args.quick else 1000)
    out = args.out or (Path(tempfile.gettempdir()) / "pair-quick.json" if args.quick
                       else RESULTS)
    roots = {"A": args.a.resolve(), "B": args.b.resolve()}
    res = run(roots, rounds, requests)
    builds = ", ".join(f"{k} {v['revision']} ({v['root']})" for k, v in res["builds"].items())
    print(f"{builds}; {requests} requests of ~{res['mean_prompt_tokens']} tokens a run, one "
          "client, rotated; ms")
    print(pair_table(res))
    print(f"B - A, mean of the rounds (each build started first once): "
          f"{res['b_minus_a_mean_ms']:+.3f} ms; the first-started build's advantage: "
          f"{res['first_started_advantage_ms']:+.3f} ms")
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
