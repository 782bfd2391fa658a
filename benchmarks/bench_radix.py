"""Radix prefix cache vs a per-token trie on an agent-shaped trace.

Many agent sessions share one long system+tools prefix and grow turn by turn (user message,
tool results, then the model's reply), interleaved at random. Every request does
``match(prompt)`` then ``insert(prompt + reply)``, as the engine does. Both caches see the same
token lists in the same run; their match lengths must agree on every request.

Run: ``.venv/bin/python benchmarks/bench_radix.py [--quick]``; writes
``benchmarks/results/bench_radix.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from radix_trace import TraceConfig, run

RESULTS = Path(__file__).parent / "results" / "bench_radix.json"


def print_table(report: dict[str, Any]) -> None:
    head = f"{'cache':<30} {'match+insert tok/s (CPU)':>26} {'hit rate':>9}"
    print(f"\n{head} {'pages':>8} {'B/page':>8}")
    for name, row in report["rows"].items():
        per_page = "-" if row["bytes_per_page"] is None else f"{row['bytes_per_page']:.0f}"
        print(
            f"{name:<30} {row['tokens_per_s']:>26,.0f} {row['hit_rate']:>9.3f} "
            f"{row['cached_pages']:>8} {per_page:>8}"
        )
    print(
        f"radix / trie throughput: {report['speedup']:.1f}x (target >= 10x; "
        f"best of {report['rounds']} interleaved rounds)"
    )
    for name, ms in report["match_32k_ms"].items():
        print(f"match 32k-token full hit, {name:<12} median {ms:8.3f} ms (target < 1 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small trace, few repeats")
    args = parser.parse_args()
    cfg = TraceConfig(sessions=4, turns=4, prefix_tokens=2000) if args.quick else TraceConfig()
    report = run(cfg, repeats=20 if args.quick else 200, rounds=1 if args.quick else 3)
    report["quick"] = args.quick
    print_table(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
