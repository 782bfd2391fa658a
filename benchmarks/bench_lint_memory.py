"""Peak memory and wall time of `prefixgate lint` and `prefixgate fix` on large logs.

Generates agent logs of the given sizes (bench_lint's generator: ~23 kB requests, sessions of
ten turns, a timestamp and a user id on top of each system prompt), then runs each command in
a fresh process and reads its peak resident memory (`getrusage(RUSAGE_SELF).ru_maxrss`) and
wall time. `--before DIR` runs the same commands from another checkout too (e.g. the commit
before the two readings), for one before/after table.

Usage: python benchmarks/bench_lint_memory.py [--sizes 50,200] [--before /path/to/checkout]
       [--quick]
Writes benchmarks/results/lint_memory.json (--quick: 5 and 10 MB, a scratch file unless --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_lint import generate_log  # noqa: E402

#: Bytes of one generated request at --tokens 4000 (measured: 232.5 MB for 10,000).
REQUEST_BYTES = 23_250
#: What the child runs: the command, then its peak RSS (kB) on the last line of stdout.
CHILD = ("import resource, sys\n"
         "from prompt_lint.cli import {main}\n"
         "code = {main}(sys.argv[1:])\n"
         "print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")


class Run(NamedTuple):
    """One command on one log from one checkout."""

    code: str
    command: str
    log_mb: float
    peak_mb: float
    seconds: float


def measure(code_root: Path, command: str, log: Path, out: Path) -> tuple[float, float]:
    """(peak RSS in MB, wall seconds) of `command` on `log` run from `code_root`."""
    main = {"lint": "lint_main", "fix": "fix_main"}[command]
    argv = [str(log), "-o", str(out)] + (["--format", "json"] if command == "lint" else [])
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD.format(main=main), *argv],
                          capture_output=True, text=True, env=env, cwd=code_root, check=False)
    seconds = time.perf_counter() - start
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    fields = last[0].split()
    if proc.returncode != 0 or len(fields) != 2 or fields[0] not in ("0", "1"):
        raise RuntimeError(f"{command} from {code_root} failed: {proc.stderr[-2000:]}")
    return int(fields[1]) / 1024, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200", help="log sizes in MB, comma-separated")
    parser.add_argument("--before", default=None, help="another checkout to measure too")
    parser.add_argument("--quick", action="store_true", help="5 and 10 MB logs")
    parser.add_argument("--out", default=None, help="JSON path (default "
                        "benchmarks/results/lint_memory.json; --quick: a scratch file)")
    args = parser.parse_args(argv)
    sizes = [5.0, 10.0] if args.quick else [float(s) for s in args.sizes.split(",")]
    out_path = Path(args.out or (Path(tempfile.gettempdir()) / "lint_memory_quick.json"
                                 if args.quick else ROOT / "benchmarks/results/lint_memory.json"))
    roots = [("before", Path(args.before).resolve())] if args.before else []
    roots.append(("after", ROOT))
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            log = Path(tmp) / f"log_{size:g}mb.jsonl"
            generate_log(log, max(10, round(size * 1e6 / REQUEST_BYTES)), 4000)
            mb = log.stat().st_size / 1e6
            for command in ("lint", "fix"):
                for name, code_root in roots:
                    out = Path(tmp) / ("report.json" if command == "lint" else "fixed.jsonl")
                    peak, seconds = measure(code_root, command, log, out)
                    runs.append(Run(name, command, round(mb, 1), round(peak, 1),
                                    round(seconds, 2)))
                    print(f"{name:<7} {command:<5} {mb:7.1f} MB log: peak {peak:8.1f} MB, "
                          f"{seconds:7.2f} s", flush=True)
            log.unlink()
    _table(runs)
    result = {"runs": [r._asdict() for r in runs], "load_average": os.getloadavg()[0]}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _table(runs: list[Run]) -> None:
    """One row per command and log size: peak RSS and wall time, before and after."""
    print(f"\n{'command':<8} {'log MB':>7} {'peak MB before':>15} {'peak MB after':>14} "
          f"{'s before':>9} {'s after':>8}")
    keys = sorted({(r.command, r.log_mb) for r in runs}, key=lambda k: (k[0] != "lint", k[1]))
    for command, mb in keys:
        row = {r.code: r for r in runs if (r.command, r.log_mb) == (command, mb)}
        before, after = row.get("before"), row["after"]
        print(f"{command:<8} {mb:7.1f} {before.peak_mb if before else '-':>15} "
              f"{after.peak_mb:>14} {before.seconds if before else '-':>9} "
              f"{after.seconds:>8}")


if __name__ == "__main__":
    sys.exit(main())
