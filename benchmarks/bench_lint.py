"""Benchmark prompt_lint: requests/s and MB/s on a generated agent log.

Generates a JSONL log of agent sessions (OpenAI and Anthropic, ~4k tokens per
request by default: a long system prompt with a timestamp and ids, tools,
growing history), then measures side by side in one run:

- `tiktoken only`: parse each line and tokenize its full layout with plain
  tiktoken (no cache), the floor any tokenizing linter pays without reuse;
- `lint (online)`: parse + `lint_request` with one learner, one request at a
  time, as the gateway runs it (tokenization included, chunk caches warm
  up inside the run);
- `lint CLI (two-pass)`: `prefixgate lint --format json` end to end
  (read, validate, learn, lint, render);
- `fix CLI`: `prefixgate fix` end to end.

Then the accuracy table: `prefixgate lint`'s (two-pass) and the gateway's
(online) precision and recall per rule on the labelled corpus of
tests/prompt_lint/lint_corpus.py, with the project's phrasing (seed 7) and
the held-out phrasing (seed 11), and whether `fix` output lints clean.

Usage: python benchmarks/bench_lint.py [--requests 10000] [--tokens 4000] [--quick]
Writes benchmarks/results/bench_lint.json (--quick: a scratch file unless --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prompt_lint import TemplateLearner, learn_request, lint_request, rewrite_request  # noqa: E402
from prompt_lint.cli import fix_main, lint_main  # noqa: E402
from prompt_lint.evidence import FIX_CONFIDENCE  # noqa: E402
from prompt_lint.providers import detect_provider, segments  # noqa: E402
from prompt_lint.tokens import DEFAULT_ENCODING, get_encoding  # noqa: E402
from tests.prompt_lint.corpus_score import Scored, score  # noqa: E402
from tests.prompt_lint.lint_corpus import build_corpus  # noqa: E402
from tests.prompt_lint.opening_corpus import (  # noqa: E402
    build_openings,
    pl014_findings,
    score_openings,
)

WORDS = ["agent", "tool", "cache", "prefix", "request", "session", "deploy", "review", "ticket",
         "runbook", "policy", "user", "answer", "search", "file", "test", "commit", "branch",
         "build", "service", "health", "metric", "alert", "backup", "restore", "network",
         "token", "budget", "latency", "error", "retry", "queue", "worker", "schedule"]


class Row(NamedTuple):
    """One measured variant: wall seconds and CPU seconds of this process."""

    name: str
    seconds: float
    cpu_seconds: float
    requests: int
    megabytes: float
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": round(self.seconds, 4),
                "cpu_seconds": round(self.cpu_seconds, 4), "requests": self.requests,
                "requests_per_s": round(self.requests / self.seconds, 1),
                "requests_per_cpu_s": round(self.requests / self.cpu_seconds, 1),
                "mb_per_s": round(self.megabytes / self.seconds, 2),
                "tokens_per_s": round(self.tokens / self.seconds)}


class Timer:
    """Wall and process CPU time of a block."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def _system(rng: random.Random, family: int, lines: int) -> list[str]:
    return [f"Rule {family}.{k}: " + " ".join(rng.choice(WORDS) for _ in range(14)) + "."
            for k in range(lines)]


def _tools(rng: random.Random, provider: str) -> list[dict[str, Any]]:
    out = []
    for name in rng.sample(["search", "read_file", "write_file", "run_tests", "open_ticket",
                            "list_dir", "http_get", "query_db"], 6):
        desc = " ".join(rng.choice(WORDS) for _ in range(40))
        schema = {"type": "object", "properties": {
            "query": {"type": "string", "description": " ".join(rng.sample(WORDS, 10))},
            "limit": {"type": "integer"}}, "required": ["query"]}
        out.append({"name": name, "description": desc, "input_schema": schema}
                   if provider == "anthropic" else
                   {"type": "function", "function": {"name": name, "description": desc,
                                                     "parameters": schema}})
    return out


def generate_log(path: Path, requests: int, tokens: int, seed: int = 0) -> None:
    """Write `requests` agent requests of about `tokens` tokens to `path` (JSONL)."""
    rng = random.Random(seed)
    families = []
    for f in range(16):
        provider = "openai" if f % 2 == 0 else "anthropic"
        families.append((provider, _system(rng, f, max(4, int(tokens * 0.55) // 19)),
                         _tools(rng, provider)))
    t0 = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
    written = 0
    with path.open("w") as out, tqdm(total=requests, desc="generate log", leave=False) as bar:
        while written < requests:
            provider, system, tools = families[rng.randrange(len(families))]
            user_id = f"u_{rng.randint(10000, 99999)}"
            history: list[dict[str, Any]] = []
            for turn in range(min(10, requests - written)):
                now = t0 + timedelta(seconds=written * 7)
                head = [f"Current time: {now.isoformat()}", f"user_id: {user_id}"]
                text = "\n".join(head + system)
                history.append({"role": "user", "content": " ".join(
                    rng.choice(WORDS) for _ in range(int(tokens * 0.03)))})
                body = _body(provider, text, tools, history)
                out.write(json.dumps(body) + "\n")
                history.append({"role": "assistant", "content": f"Done with step {turn}: " +
                                " ".join(rng.choice(WORDS) for _ in range(int(tokens * 0.02)))})
                written += 1
                bar.update(1)


def _body(provider: str, system: str, tools: list[dict[str, Any]],
          history: list[dict[str, Any]]) -> dict[str, Any]:
    if provider == "anthropic":
        return {"model": "claude-sonnet-4-5", "max_tokens": 512, "system": system,
                "tools": tools, "messages": history}
    return {"model": "gpt-4o", "tools": tools,
            "messages": [{"role": "system", "content": system}] + history}


def bench_tiktoken(lines: list[str]) -> tuple[Timer, int]:
    encoding = get_encoding(DEFAULT_ENCODING)
    total = 0
    with Timer() as timer:
        for line in tqdm(lines, desc="tiktoken only", leave=False):
            body = json.loads(line)
            text = "".join(s.text for s in segments(body, detect_provider(body)))
            total += len(encoding.encode_ordinary(text))
    return timer, total


def bench_online(lines: list[str]) -> tuple[Timer, int, int]:
    learner = TemplateLearner()
    total = findings = 0
    with Timer() as timer:
        for line in tqdm(lines, desc="lint (online)", leave=False):
            report = lint_request(json.loads(line), learner=learner)
            total += report.prompt_tokens
            findings += len(report.findings)
    return timer, total, findings


def bench_cli(func: Any, argv: list[str]) -> Timer:
    with Timer() as timer:
        code = func(argv)
    if code not in (0, 1):
        raise RuntimeError(f"{argv[0]} exited {code}")
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=4000, help="approximate tokens per request")
    parser.add_argument("--quick", action="store_true", help="1,000 requests")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/bench_lint.json; "
                        "--quick: a scratch file in the temp folder)")
    args = parser.parse_args(argv)
    n = 1000 if args.quick else args.requests
    out_path = Path(args.out or (Path(tempfile.gettempdir()) / "bench_lint_quick.json"
                                 if args.quick else "benchmarks/results/bench_lint.json"))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        generate_log(log, n, args.tokens)
        lines = log.read_text().splitlines()
        mb = log.stat().st_size / 1e6
        base, tokens = bench_tiktoken(lines)
        online, linted_tokens, findings = bench_online(lines)
        cli = bench_cli(lint_main, [str(log), "--format", "json", "-o", os.devnull])
        fix = bench_cli(fix_main, [str(log), "-o", str(Path(tmp) / "fixed.jsonl")])
    rows = [Row("tiktoken only (no cache)", base.wall, base.cpu, n, mb, tokens),
            Row("lint (online, gateway path)", online.wall, online.cpu, n, mb, linted_tokens),
            Row("prefixgate lint (two-pass, json)", cli.wall, cli.cpu, n, mb, linted_tokens),
            Row("prefixgate fix", fix.wall, fix.cpu, n, mb, linted_tokens)]
    _print(rows, n, tokens / n, mb, findings)
    accuracy = measure_accuracy()
    _print_accuracy(accuracy)
    openings = measure_openings()
    result = {"requests": n, "mean_tokens": round(tokens / n), "log_mb": round(mb, 2),
              "findings_online": findings, "rows": [r.as_dict() for r in rows],
              "target_requests_per_s": {"online": 2000, "cli": 1500},
              "load_average": os.getloadavg()[0], "accuracy": accuracy,
              "accuracy_openings": openings}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def _print(rows: list[Row], n: int, mean_tokens: float, mb: float, findings: int) -> None:
    print(f"\nprompt_lint on {n} requests, mean {mean_tokens:.0f} tokens, {mb:.1f} MB "
          f"({findings} findings online)")
    print(f"{'variant':<34} {'wall s':>7} {'req/s':>7} {'req/cpu-s':>9} {'MB/s':>6} "
          f"{'Mtok/s':>7}")
    for r in rows:
        print(f"{r.name:<34} {r.seconds:7.2f} {r.requests / r.seconds:7.0f} "
              f"{r.requests / r.cpu_seconds:9.0f} {r.megabytes / r.seconds:6.1f} "
              f"{r.tokens / r.seconds / 1e6:7.2f}")
    print("req/s: wall clock, one process on one core; req/cpu-s: per second of this "
          "process's CPU time (less sensitive to other load on the machine)")


ACCURACY_RULES = ("dynamic", "PL001", "PL002", "PL003", "PL008", "PL013", "PL004", "PL006",
                  "PL009")


def measure_accuracy() -> dict[str, Any]:
    """Precision/recall per rule, two-pass and online, on both corpus phrasings, and the
    error-level findings left in `lint(fix(x))` (two-pass)."""
    out: dict[str, Any] = {}
    for name, seed, phrasing in (("project", 7, "train"), ("held-out", 11, "holdout")):
        corpus = build_corpus(seed=seed, phrasing=phrasing)
        learner = TemplateLearner()
        for req in corpus:
            learn_request(req.body, learner)
        learner.freeze()
        reports = [lint_request(req.body, learner=learner) for req in corpus]
        fixed = [rewrite_request(req.body, report=rep, learner=learner).body
                 for req, rep in zip(corpus, reports, strict=True)]
        online = TemplateLearner()
        live = [lint_request(req.body, learner=online) for req in corpus]
        out[name] = {"requests": len(corpus),
                     "two_pass": _rounded(score(Scored(corpus, reports))),
                     "online": _rounded(score(Scored(corpus, live))),
                     "online_fixable": _rounded(score(Scored(corpus, live), FIX_CONFIDENCE)),
                     "fix_errors": _fix_errors(fixed)}
    return out


def measure_openings() -> dict[str, list[float]]:
    """PL014's precision/recall on the labelled openings of tests/prompt_lint/opening_corpus.py
    (values above a guide every session sends; dates and ids where moving them shares nothing),
    two-pass and online; printed as one line."""
    requests = build_openings()
    out = {mode: [round(x, 3) for x in score_openings(requests, pl014_findings(requests, online))]
           for mode, online in (("two_pass", False), ("online", True))}
    print(f"PL014 on {len(requests)} labelled openings: " + ", ".join(
        f"{mode} {p:.3f}/{r:.3f} n={n:.0f}" for mode, (p, r, n) in out.items()))
    return out


def _rounded(scores: dict[str, tuple[float, float, int]]) -> dict[str, list[float]]:
    return {rule: [round(p, 3), round(r, 3), n] for rule, (p, r, n) in scores.items()}


def _fix_errors(fixed: list[dict[str, Any]]) -> dict[str, int]:
    """Error-level findings per rule when the fixed log is linted (two-pass)."""
    learner = TemplateLearner()
    for body in fixed:
        learn_request(body, learner)
    learner.freeze()
    counts: dict[str, int] = {}
    for body in fixed:
        for f in lint_request(body, learner=learner).findings:
            if f.severity == "error":
                counts[f.rule] = counts.get(f.rule, 0) + 1
    return counts


def _print_accuracy(accuracy: dict[str, Any]) -> None:
    print("\nprecision/recall on the labelled corpus (n = labels or structural cases; "
          "online>=0.8: only findings fix would move)")
    print(f"{'rule':<8} " + " ".join(f"{n + ' ' + m:>22}" for n in accuracy
                                      for m in ("two-pass", "online", "online>=0.8")))
    for rule in ACCURACY_RULES:
        cells = []
        for name in accuracy:
            for mode in ("two_pass", "online", "online_fixable"):
                p, r, n = accuracy[name][mode].get(rule, [1.0, 1.0, 0])
                cells.append(f"{p:.3f}/{r:.3f} n={n:<4}")
        print(f"{rule:<8} " + " ".join(f"{c:>22}" for c in cells))
    for name in accuracy:
        print(f"{name}: {accuracy[name]['requests']} requests; error findings in "
              f"lint(fix(x)): {accuracy[name]['fix_errors'] or 'none'} (PL009 = the client's "
              "own history edits, which fix does not undo)")


if __name__ == "__main__":
    sys.exit(main())
