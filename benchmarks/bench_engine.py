"""Agent-trace benchmark of the engine: prefix caching on vs off vs transformers (vs llama.cpp).

The trace: 4 agent sessions run concurrently, 5 turns each. Every prompt starts with the same
~600-token system prompt + tool definitions; each turn appends the model's own previous reply
and ~60 tokens of tool output, then generates exactly 32 tokens (stop tokens ignored). Each
session sends its next turn as soon as its previous reply is done (an agent loop).

Side by side in one run, on the same GGUF (SmolLM2-135M-Instruct from the wheel):
- this engine with prefix caching, and without it (continuous batching in both);
- `transformers` (its own `generate`, one request at a time in trace order);
- llama.cpp through `llama-cpp-python` when installed (one context, trace order), paired with
  the cached engine in A B B A order, each keeping its faster run, so the headline ratio sees
  one machine load (each system's 1-minute load average at its start is in the table: on a
  shared 2-core machine two-thread runs slow down many times over when other work runs).
Reported: total wall time, prompt tokens computed vs total, mean TTFT, mean TPOT, output
tokens/s; then the rows of `engine_rows`: single-stream decode TPOT per weight format beside
its memory-bandwidth floor (streamed weight bytes / copy bandwidth measured in this run),
1/4/8-stream decode tokens/s, decode TPOT after 4k and 8k-token prompts (the engine's float32
and float16 KV caches) and cold prefill at 1k/4k/8k tokens, llama.cpp beside each. The engine's
KV cache is `--kv-cache-dtype` (default float16, as `make serve` and as llama.cpp's).
Every system runs with the same thread count (`--threads`, default: every core).

    pip install -e '.[bench]'    # llama-cpp-python: compiles llama.cpp (~10-40 min)
    PYTHONPATH=$PWD python benchmarks/bench_engine.py [--quick] [--threads N] [--quantization fp16]

`--quick` (a smaller trace and rows) writes to results/bench_engine.quick.json, never over the
committed results/bench_engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from engine_rows import (
    LlamaCpp,
    context_rows,
    decode_rows,
    format_rows,
    kv_for,
    open_llama_cpp,
    prefill_rows,
    stream_rows,
)
from tqdm import tqdm

from engine import Engine, EngineConfig, SamplingParams
from engine.config import KV_CACHE_DTYPES, available_cores
from engine.linear import QUANTIZATIONS
from engine.loader import LoadedModel, default_model_path, load_model

RESULTS = Path(__file__).parent / "results" / "bench_engine.json"
QUICK_RESULTS = Path(__file__).parent / "results" / "bench_engine.quick.json"

SYSTEM_PROMPT = (
    "You are Forge, an autonomous software engineering agent working inside a Linux "
    "container on a Python repository. You solve the user's task by calling tools, one call "
    "per turn, and reading their output carefully before the next step. Rules: never invent "
    "file contents; read a file before editing it; keep edits minimal and in the style of the "
    "surrounding code; run the tests after every change; when a command fails, read the error "
    "and fix the cause rather than the symptom. Prefer small, reversible steps. Report what "
    "you changed and why in one short paragraph when the task is done. Answer tool calls as a "
    "single JSON object with the keys name and arguments. The repository uses Python 3.11, "
    "pytest, ruff and mypy; the package lives under src/ and the tests under tests/. Do not "
    "touch files under vendor/ or any generated file. Never push, never rewrite history, "
    "never delete branches. If the task is ambiguous, state your assumption and proceed."
)

TOOLS: list[dict[str, Any]] = [
    {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": sorted(props)}}
    for name, desc, props in [
        ("read_file", "Read a text file and return its contents with line numbers.",
         {"path": {"type": "string", "description": "path relative to the repository root"}}),
        ("write_file", "Replace a file's contents.",
         {"path": {"type": "string"}, "content": {"type": "string"}}),
        ("run_command", "Run a shell command in the repository and return stdout and stderr.",
         {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}),
        ("search_code", "Search the repository for a regular expression.",
         {"pattern": {"type": "string"}, "glob": {"type": "string"}}),
        ("list_dir", "List the entries of a directory.", {"path": {"type": "string"}}),
        ("run_tests", "Run pytest on a path and return the summary.",
         {"path": {"type": "string"}, "keyword": {"type": "string"}}),
    ]
]  # fmt: skip

TASKS = [
    "The CSV exporter drops the header row when the table is empty. Find and fix it.",
    "Add a --dry-run flag to the cleanup command that prints what would be deleted.",
    "The retry helper sleeps one second too long on the last attempt; make the test pass.",
    "Rename the config key cache_dir to cache_path everywhere, keeping the old key working.",
]


def tool_output(session: int, turn: int) -> str:
    """~60 tokens of deterministic, turn-specific tool output."""
    lines = [f"$ run_tests tests/test_module_{session}.py  (turn {turn})"]
    for i in range(3):
        n = (session * 7 + turn * 3 + i) % 11
        lines.append(f"tests/test_module_{session}.py::test_case_{n} {'PASSED' if i else 'FAILED'}")
    lines.append(f"E   AssertionError: expected {turn * 17 + session} rows, got {turn * 13}")
    lines.append(f"=== 1 failed, 2 passed in 0.{turn}{session}s ===")
    return "\n".join(lines)


@dataclass
class Session:
    index: int
    messages: list[dict[str, Any]]
    turn: int = 0


@dataclass
class RequestStat:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft: float
    tpot: float


@dataclass
class SystemResult:
    name: str
    wall_s: float | None = None
    prompt_tokens_total: int = 0
    prompt_tokens_computed: int = 0
    mean_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    output_tokens_per_s: float | None = None
    load_before: float | None = None  # 1-minute load average when the system started
    note: str = ""
    requests: list[RequestStat] = field(default_factory=list)


class Trace:
    """Builds each session's next prompt from its history."""

    def __init__(self, sessions: int, turns: int, tokenizer: Any) -> None:
        self.turns = turns
        self.tokenizer = tokenizer
        system = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.sessions = [
            Session(i, system + [{"role": "user", "content": TASKS[i % len(TASKS)]}])
            for i in range(sessions)
        ]

    def prompt(self, s: Session) -> list[int]:
        return self.tokenizer.apply_chat_template(s.messages, TOOLS)

    def record_reply(self, s: Session, reply_ids: list[int]) -> None:
        """Append the reply (up to its first stop token) and the next tool output."""
        stops = self.tokenizer.stop_token_ids
        cut = next((i for i, t in enumerate(reply_ids) if t in stops), len(reply_ids))
        s.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply_ids[:cut])})
        s.messages.append({"role": "tool", "content": tool_output(s.index, s.turn + 1)})
        s.turn += 1


# --------------------------------------------------------------------------- engine
def run_engine(
    loaded: LoadedModel, caching: bool, sessions: int, turns: int, gen: int, kv: str = "auto"
) -> SystemResult:
    config = EngineConfig(enable_prefix_caching=caching, num_pages=1024,
                          kv_cache_dtype=kv_for(loaded, kv))  # type: ignore[arg-type]
    eng = Engine(config, model=loaded)
    trace = Trace(sessions, turns, loaded.tokenizer)
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    owner: dict[str, Session] = {}
    weights = getattr(loaded.model, "quantization", "none")
    name = f"prefixgate engine ({weights}), cache " + ("on" if caching else "off")
    result = SystemResult(name, load_before=os.getloadavg()[0])
    bar = tqdm(total=sessions * turns, desc=result.name, leave=False)
    start = time.perf_counter()
    for s in trace.sessions:
        owner[eng.add_request(trace.prompt(s), params)] = s
    while eng.has_unfinished():
        for update in eng.step():
            if update.output is None:
                continue
            s, out = owner.pop(update.request_id), update.output
            result.requests.append(RequestStat(s.index, s.turn, out.prompt_tokens,
                out.cached_tokens, out.completion_tokens, out.ttft, out.tpot))  # fmt: skip
            bar.update()
            trace.record_reply(s, out.token_ids)
            if s.turn < turns:
                owner[eng.add_request(trace.prompt(s), params)] = s
    result.wall_s = time.perf_counter() - start
    bar.close()
    eng.check()
    result.prompt_tokens_computed = eng.stats().prefill_tokens_computed
    return summarise(result)


# --------------------------------------------------------------------------- transformers
class _TokenClock:
    """A StoppingCriteria that timestamps every generated token and never stops."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_transformers(tokenizer: Any, sessions: int, turns: int, gen: int) -> SystemResult:
    result = SystemResult("transformers generate (fp32 weights, trace order)",
                          load_before=os.getloadavg()[0])
    try:
        from transformers import AutoModelForCausalLM, StoppingCriteriaList
    except ImportError as exc:  # pragma: no cover - dev dependency
        result.note = f"not available: {exc}"
        return result
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    trace = Trace(sessions, turns, tokenizer)
    order = [(t, s) for t in range(turns) for s in trace.sessions]
    start = time.perf_counter()
    for _, s in tqdm(order, desc=result.name, leave=False):
        ids = trace.prompt(s)
        clock = _TokenClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0,
            )  # fmt: skip
        reply = out[0, len(ids) :].tolist()
        ttft = clock.times[0] - t0
        tpot = (clock.times[-1] - clock.times[0]) / max(len(clock.times) - 1, 1)
        result.requests.append(RequestStat(s.index, s.turn, len(ids), 0, len(reply), ttft, tpot))
        trace.record_reply(s, reply)
    result.wall_s = time.perf_counter() - start
    result.prompt_tokens_computed = sum(r.prompt_tokens for r in result.requests)
    del model
    return summarise(result)


def run_llama_cpp(
    lcpp: LlamaCpp | None, missing: str, tokenizer: Any, sessions: int, turns: int, gen: int
) -> SystemResult:
    """llama.cpp in trace order, one context, its default prefix reuse (the longest common
    prefix with the previous prompt is kept; the rest is evaluated)."""
    result = SystemResult("llama.cpp Q4_1 GGUF (llama-cpp-python, trace order)",
                          load_before=os.getloadavg()[0])
    if lcpp is None:
        result.note = missing
        return result
    llm = lcpp.llm
    llm.reset()
    trace = Trace(sessions, turns, tokenizer)
    order = [(t, s) for t in range(turns) for s in trace.sessions]
    start = time.perf_counter()
    for _, s in tqdm(order, desc=result.name, leave=False):
        ids = trace.prompt(s)
        t0 = time.perf_counter()
        times, reply = [], []
        for token in llm.generate(ids, temp=0.0):
            times.append(time.perf_counter())
            reply.append(token)
            if len(reply) == gen:
                break
        tpot = (times[-1] - times[0]) / max(len(times) - 1, 1)
        result.requests.append(RequestStat(s.index, s.turn, len(ids), 0, len(reply),
                                           times[0] - t0, tpot))  # fmt: skip
        trace.record_reply(s, reply)
    result.wall_s = time.perf_counter() - start
    result.prompt_tokens_computed = sum(r.prompt_tokens for r in result.requests)
    result.note = "llama.cpp reports no prompt tokens computed (prefix reuse on): counted as all"
    return summarise(result)


def paired_trace(
    loaded: LoadedModel, lcpp: LlamaCpp | None, missing: str, shape: tuple[int, int, int],
    kv: str = "auto",
) -> tuple[SystemResult, SystemResult]:
    """The cached engine and llama.cpp on the trace in A B B A order; each keeps its faster run.

    Both systems then see the same machine load on average even when it drifts (a shared
    2-core machine: other work slows two-thread runs many times over, see the load column)."""
    def engine() -> SystemResult:
        return run_engine(loaded, True, *shape, kv)

    def llama() -> SystemResult:
        return run_llama_cpp(lcpp, missing, loaded.tokenizer, *shape)

    first_engine, first_llama = engine(), llama()
    second_llama, second_engine = llama(), engine()
    return _faster(first_engine, second_engine), _faster(first_llama, second_llama)


def _faster(a: SystemResult, b: SystemResult) -> SystemResult:
    if a.wall_s is None or b.wall_s is None:
        return a
    best, other = (a, b) if a.wall_s <= b.wall_s else (b, a)
    best.note = (best.note + "; " if best.note else "") + (
        f"faster of 2 runs (A B B A order; other {other.wall_s:.1f} s at load "
        f"{other.load_before or 0.0:.1f})"
    )
    return best


def summarise(result: SystemResult) -> SystemResult:
    reqs = result.requests
    result.prompt_tokens_total = sum(r.prompt_tokens for r in reqs)
    result.mean_ttft_ms = 1e3 * statistics.fmean(r.ttft for r in reqs)
    result.mean_tpot_ms = 1e3 * statistics.fmean(r.tpot for r in reqs)
    assert result.wall_s is not None
    result.output_tokens_per_s = sum(r.completion_tokens for r in reqs) / result.wall_s
    return result


# --------------------------------------------------------------------------- report
def format_table(results: list[SystemResult]) -> str:
    head = (f"{'system':<52} {'wall s':>8} {'prompt computed/total':>24} {'TTFT ms':>9} "
            f"{'TPOT ms':>8} {'out tok/s':>9} {'load':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in results:
        if r.wall_s is None:
            lines.append(f"{r.name:<52} {r.note}")
            continue
        share = r.prompt_tokens_computed / max(r.prompt_tokens_total, 1)
        computed = f"{r.prompt_tokens_computed}/{r.prompt_tokens_total} ({share:.0%})"
        lines.append(f"{r.name:<52} {r.wall_s:>8.1f} {computed:>24} {r.mean_ttft_ms:>9.0f} "
                     f"{r.mean_tpot_ms:>8.1f} {r.output_tokens_per_s:>9.1f} "
                     f"{r.load_before or 0.0:>5.1f}")  # fmt: skip
        if r.note:
            lines.append(f"    {r.note}")
    return "\n".join(lines)


def speedups(results: list[SystemResult]) -> dict[str, float | None]:
    on = results[0].wall_s
    return {f"vs {r.name}": (r.wall_s / on) if r.wall_s and on else None for r in results[1:]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="small trace and rows, scratch JSON")
    parser.add_argument("--threads", type=int, default=available_cores(),
                        help="threads for every system (default: every core)")
    parser.add_argument("--quantization", default="fp16", choices=list(QUANTIZATIONS),
                        help="weights of the engine in the trace and the stream/prefill rows")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-trace", action="store_true", help="only the micro rows")
    parser.add_argument("--tokens", type=int, default=None,
                        help="generated tokens per decode row (default 64; --quick 16)")
    parser.add_argument("--kv-cache-dtype", default="float16", choices=KV_CACHE_DTYPES,
                        help="the engine's KV cache (default float16, as `make serve`; "
                             "llama.cpp's is float16; the long-context rows show both)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="decode-after-a-long-prompt sizes (default 4000 8000; --quick 1024)")
    parser.add_argument("--prefill", type=int, nargs="+", default=None,
                        help="prefill prompt sizes (default 1024 4096 8000; --quick 512 1024)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    sessions, turns, gen = (2, 2, 8) if args.quick else (4, 5, 32)
    lcpp, missing = open_llama_cpp(args.threads)
    loaded = load_model(None, quantization=args.quantization)
    results: list[SystemResult] = []
    if not args.skip_trace:
        # the engine and llama.cpp back to back, so the headline ratio sees one machine load
        kv = args.kv_cache_dtype
        results = [*paired_trace(loaded, lcpp, missing, (sessions, turns, gen), kv),
                   run_engine(loaded, False, sessions, turns, gen, kv)]  # fmt: skip
        if not args.skip_transformers:
            results.append(run_transformers(loaded.tokenizer, sessions, turns, gen))
        print(format_table(results), flush=True)
    tokens = args.tokens or (16 if args.quick else 64)
    sizes = tuple(args.prefill or ((512, 1024) if args.quick else (1024, 4096, 8000)))
    variants = {q: loaded if q == args.quantization else load_model(None, quantization=q)
                for q in QUANTIZATIONS}  # fmt: skip
    contexts = tuple(args.contexts or ((1024,) if args.quick else (4000, 8000)))
    rows = decode_rows(variants, lcpp, tokens, args.kv_cache_dtype)
    del variants
    rows += stream_rows(loaded, lcpp, tokens, args.kv_cache_dtype)
    rows += context_rows(loaded, lcpp, tokens, contexts)
    rows += prefill_rows(loaded, lcpp, sizes, args.kv_cache_dtype)
    table = format_table(results) + "\n\n" + format_rows(rows)
    print(f"\ntrace: {sessions} sessions x {turns} turns, {gen} generated tokens per turn; "
          f"engine weights: {args.quantization}, KV cache {args.kv_cache_dtype}; "
          f"threads (every system): {args.threads}; "
          f"llama.cpp: {'yes' if lcpp else missing}")
    print(table)
    ratio = speedups(results) if results else {}
    for name, value in ratio.items():
        print(f"cache-on speedup {name}: {value:.2f}x" if value else f"{name}: n/a")
    out = QUICK_RESULTS if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "trace": {"sessions": sessions, "turns": turns, "generated_tokens": gen,
                  "quick": args.quick, "engine_quantization": args.quantization,
                  "engine_kv_cache_dtype": args.kv_cache_dtype},
        "machine": {"platform": platform.platform(), "threads": args.threads,
                    "load_average": list(os.getloadavg())},
        "systems": [asdict(r) for r in results],
        "speedup_of_cache_on": ratio,
        "rows": [{**asdict(r), "ratio": r.ratio} for r in rows],
        "table": table,
    }, indent=2))  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
