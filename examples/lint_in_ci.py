"""prompt_lint as a CI gate: fail the build when a prompt log carries cache killers.

Usage:
    python examples/lint_in_ci.py LOG.jsonl [--sarif lint.sarif] [--min-hit-rate 0.5]
    python examples/lint_in_ci.py --demo        # a demo log: the gate fails, then passes on
                                                # the log `prefixgate fix` wrote

Two gates, both typical for a CI job that replays an agent's recorded requests:
1. `prefixgate lint --fail-on error` (the CLI entry point, in-process), which
   also writes a SARIF file for the code-scanning UI;
2. a budget on the share of prompt tokens that stays cacheable, computed with
   the library (`lint_request` with one TemplateLearner over the log).
Exit status: 0 pass, 1 gate failed, 2 bad input (`--demo`: 0 when the gate failed the demo
log and passed its fixed copy).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from prompt_lint import TemplateLearner, learn_request, lint_request
from prompt_lint.cli import fix_main, lint_main
from prompt_lint.loader import InputError, load_requests


def demo_log(path: Path) -> Path:
    """A tiny agent log, two sessions of three turns, with two classic cache killers on
    top of the system prompt: the time (every request) and the user id (every session)."""
    guide = "\n".join(f"Rule {i}: answer questions about area {i} briefly." for i in range(40))
    with path.open("w") as out:
        for n, user in enumerate(("u_4242", "u_5151")):
            history: list[dict[str, str]] = []
            for turn in range(3):
                system = f"Current time: 2026-11-29T1{n}:0{turn}:00Z\nuser_id: {user}\n{guide}"
                history.append({"role": "user", "content": f"question {turn} from {user}"})
                body = {"model": "gpt-4o-mini",
                        "messages": [{"role": "system", "content": system}, *history]}
                out.write(json.dumps(body) + "\n")
                history.append({"role": "assistant", "content": f"answer {turn}"})
    return path


def cacheable_share(log: str) -> tuple[float, float, Counter[str]]:
    """(cacheable share now, after `prefixgate fix`, findings per rule) over the log."""
    requests = load_requests([log])
    learner = TemplateLearner()
    for req in requests:
        learn_request(req.body, learner, req.provider)
    learner.freeze()
    reports = [lint_request(r.body, r.provider, learner=learner) for r in requests]
    total = sum(r.prompt_tokens for r in reports) or 1
    rules = Counter(f.rule for r in reports for f in r.findings)
    return (sum(r.cacheable_tokens for r in reports) / total,
            sum(r.cacheable_tokens_after_fix for r in reports) / total, rules)


def gate(log: str, sarif: str, min_hit_rate: float) -> int:
    """Both gates over `log`: 0 pass, 1 failed, 2 bad input."""
    code = lint_main([log, "--fail-on", "error", "--format", "sarif", "-o", sarif])
    if code == 2:
        return 2
    try:
        now, after, rules = cacheable_share(log)
    except InputError as exc:
        print(f"bad input: {exc}", file=sys.stderr)
        return 2
    print(f"lint gate: {'FAIL' if code else 'pass'} ({dict(sorted(rules.items()))})")
    print(f"cacheable share: {now:.1%} now, {after:.1%} after `prefixgate fix` "
          f"(budget {min_hit_rate:.0%})")
    if code or now < min_hit_rate:
        print("fix: run `prefixgate fix LOG -o FIXED.jsonl` or move dynamic values out of the "
              "system prompt")
        return 1
    return 0


def demo(tmp: Path, sarif: str | None, min_hit_rate: float) -> int:
    """The gate on a demo log with two cache killers (it fails), then on the log `prefixgate
    fix` makes of it (it passes): 0 when both happen."""
    raw = demo_log(tmp / "demo.jsonl")
    print(f"== the demo log ({raw.name}): the time and a user id on top of the system prompt")
    failed = gate(str(raw), str(tmp / "raw.sarif"), min_hit_rate) == 1
    fixed = tmp / "fixed.jsonl"
    print(f"\n== prefixgate fix {raw.name} -o {fixed.name}")
    if fix_main([str(raw), "-o", str(fixed)]) != 0:
        return 1
    passed = gate(str(fixed), sarif or str(tmp / "fixed.sarif"), min_hit_rate) == 0
    print(f"\ndemo: the gate {'failed' if failed else 'passed'} the raw log and "
          f"{'passed' if passed else 'failed'} the fixed one")
    return 0 if failed and passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", nargs="?", help="JSONL / JSON request log")
    parser.add_argument("--demo", action="store_true", help="check a generated demo log")
    parser.add_argument("--sarif", default=None, help="also write SARIF here")
    parser.add_argument("--min-hit-rate", type=float, default=0.5,
                        help="fail when less than this share of prompt tokens is cacheable")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.demo or not args.log:
            return demo(Path(tmp), args.sarif, args.min_hit_rate)
        return gate(args.log, args.sarif or str(Path(tmp) / "lint.sarif"), args.min_hit_rate)

if __name__ == "__main__":
    sys.exit(main())
