"""Prompt-lookup speculative decoding: decode tokens/s with and without, on three traces.

Traces (SmolLM2-135M-Instruct from the wheel, chat template, temperature 0):
(a) code edit: the prompt holds a 200-line Python file and asks for it back with one function
    renamed (400 tokens);
(b) JSON tool arguments: a tool result with records, the model calls a tool copying one
    record's values;
(c) free chat: a question with nothing in the context to copy.

Side by side in one run, same torch threads for every system, repetitions interleaved:
- this engine without speculation, and with `EngineConfig(speculative="ngram")`;
- llama.cpp through llama-cpp-python without a draft and with its own
  `LlamaPromptLookupDecoding`, on the same GGUF and the same prompt token ids (when installed).
The engine runs interleave the two engines step by step (this machine's load changes by the
second) and time each engine's own decode steps: decode tokens/s = (completion tokens - 1) /
(sum of the steps after the first token), so prefill is excluded. llama.cpp's tokens/s is
(tokens - 1) / (time of last token - time of first token) of its stream.
Reported per trace: tokens/s of each system, the speed-up, acceptance
rate (accepted / drafted), tokens per decode step, and whether the speculative output equals
the plain one token for token.

    python benchmarks/bench_speculative.py [--quick] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.loader import LoadedModel, default_model_path, load_model

RESULTS = Path(__file__).parent / "results" / "bench_speculative.json"
SCRATCH = Path("/tmp/prefixgate_bench_speculative_quick.json")


# ---------------------------------------------------------------------------- traces
def source_file(lines: int = 200) -> str:
    """A deterministic ~`lines`-line Python module of small functions."""
    out = ['"""Inventory helpers."""', "", "from __future__ import annotations", ""]
    names = ["apples", "pears", "plums", "grapes", "lemons", "cherries", "melons", "figs"]
    i = 0
    while len(out) < lines - 8:
        item = names[i % len(names)]
        out += [
            "",
            f"def count_{item}_{i}(stock: dict[str, int], extra: int = {i % 7}) -> int:",
            f'    """Return how many {item} are in stock, plus {i % 7} spare."""',
            f'    value = stock.get("{item}", 0) + extra',
            f"    if value > {10 * (i + 1)}:",
            f"        return {10 * (i + 1)}",
            "    return value",
        ]
        i += 1
    out += ["", "", "def compute_total(stock: dict[str, int]) -> int:",
            '    """Sum of every item in stock."""', "    return sum(stock.values())", ""]
    return "\n".join(out[:lines])


def tool_result() -> str:
    records = [
        {"id": f"rec-{i:04d}", "owner": f"user{i}@example.com",
         "path": f"/srv/data/part-{i:03d}.csv", "size_bytes": 1000 + 37 * i,
         "tags": ["nightly", f"shard-{i % 4}"], "checksum": f"{i * 7919:08x}"}
        for i in range(12)
    ]
    return json.dumps({"status": "ok", "records": records}, indent=2)


def traces(max_tokens: int) -> dict[str, tuple[list[dict[str, Any]], int]]:
    """name -> (chat messages, max_tokens)."""
    code = source_file()
    code_edit = [
        {"role": "system", "content": "You are a careful coding assistant."},
        {"role": "user", "content": "Here is `inventory.py`:\n```python\n" + code + "\n```\n"
         "Rename `count_apples_0` to `count_apples_first` and reply with the whole updated file "
         "in one ```python block, every other line unchanged."},
    ]
    json_args = [
        {"role": "system", "content": "You are an operations agent. Call tools by writing one "
         "JSON object with the keys name and arguments."},
        {"role": "user", "content": "List the nightly records."},
        {"role": "assistant",
         "content": '{"name": "list_records", "arguments": {"tag": "nightly"}}'},
        {"role": "user", "content": "Tool result:\n" + tool_result() + "\n\nNow call "
         "`archive_records` with the full JSON objects of records rec-0003, rec-0004 and "
         "rec-0005 exactly as returned (all fields)."},
    ]
    chat = [
        {"role": "system", "content": "You are a friendly assistant."},
        {"role": "user", "content": "Write a short story about a lighthouse keeper who finds a "
         "message in a bottle. Make it vivid and original."},
    ]
    return {"code_edit": (code_edit, max_tokens), "json_args": (json_args, max_tokens // 2),
            "free_chat": (chat, max_tokens // 2)}


# ---------------------------------------------------------------------------- systems
@dataclass
class Run:
    """One generation: tokens and decode timing."""

    token_ids: list[int]
    decode_tps: float
    drafted: int = 0
    accepted: int = 0
    decode_steps: int = 0


def run_pair(plain: Engine, spec: Engine, prompt: list[int], max_tokens: int) -> tuple[Run, Run]:
    """The same request through both engines, their steps interleaved (plain, spec, plain, ...)
    so both see the same machine load; each engine's decode time is the sum of its own decode
    steps (every step after the one that produced the first token)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engines = (plain, spec)
    rids = [eng.add_request(prompt, params) for eng in engines]
    outputs: list[Any] = [None, None]
    decode_time, steps = [0.0, 0.0], [0, 0]
    while any(o is None for o in outputs):
        for i, eng in enumerate(engines):
            if outputs[i] is not None:
                continue
            start = time.perf_counter()
            updates = [u for u in eng.step() if u.request_id == rids[i]]
            elapsed = time.perf_counter() - start
            if updates and steps[i] > 0:
                decode_time[i] += elapsed
            steps[i] += 1 if updates else 0
            outputs[i] = next((u.output for u in updates if u.output), None)
    runs = []
    for i, out in enumerate(outputs):
        tps = (out.completion_tokens - 1) / decode_time[i] if decode_time[i] else 0.0
        runs.append(Run(out.token_ids, tps, out.draft_tokens, out.accepted_tokens, steps[i] - 1))
    return runs[0], runs[1]


class LlamaCpp:
    """llama-cpp-python on the same GGUF; optional prompt-lookup draft model."""

    def __init__(self, threads: int, lookup: bool, num_pred_tokens: int) -> None:
        import llama_cpp  # type: ignore[import-not-found]
        from llama_cpp.llama_speculative import (  # type: ignore[import-not-found]
            LlamaPromptLookupDecoding,
        )

        draft = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens) if lookup else None
        # prompt lookup verifies drafts from the logits of every position: logits_all
        self.llm = llama_cpp.Llama(str(default_model_path()), n_ctx=4096, n_threads=threads,
                                   n_threads_batch=threads, draft_model=draft,
                                   logits_all=lookup, verbose=False)

    def __call__(self, prompt: list[int], max_tokens: int) -> Run:
        self.llm.reset()
        times: list[float] = []
        ids: list[int] = []
        stream = self.llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0,
                                            top_k=1, stream=True)
        for chunk in stream:
            times.append(time.perf_counter())
            ids.append(0)
            del chunk
        tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return Run(ids, tps)


def make_llama(threads: int, num_pred: int) -> tuple[LlamaCpp | None, LlamaCpp | None, str]:
    try:
        plain = LlamaCpp(threads, False, num_pred)
        lookup = LlamaCpp(threads, True, num_pred)
    except ImportError:
        return None, None, "llama-cpp-python not installed (bench extra)"
    return plain, lookup, ""


# ---------------------------------------------------------------------------- run
@dataclass
class TraceResult:
    name: str
    prompt_tokens: int
    completion_tokens: int
    plain_tps: list[float] = field(default_factory=list)
    spec_tps: list[float] = field(default_factory=list)
    llama_tps: list[float] = field(default_factory=list)
    llama_lookup_tps: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    decode_steps: int = 0
    identical: bool = True

    def summary(self) -> dict[str, Any]:
        med = _median
        plain, spec = med(self.plain_tps), med(self.spec_tps)
        lp, ll = med(self.llama_tps), med(self.llama_lookup_tps)
        return {
            "trace": self.name, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "plain_tok_s": plain, "spec_tok_s": spec,
            "speedup": spec / plain if plain and spec else None,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "tokens_per_step": (self.completion_tokens - 1) / self.decode_steps
            if self.decode_steps else None,
            "identical_at_t0": self.identical,
            "llama_cpp_tok_s": lp, "llama_cpp_lookup_tok_s": ll,
            "llama_cpp_speedup": ll / lp if lp and ll else None,
        }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_trace(name: str, prompt: list[int], max_tokens: int, plain: Engine, spec: Engine,
              llama: tuple[LlamaCpp | None, LlamaCpp | None], reps: int) -> TraceResult:
    result: TraceResult | None = None
    for rep in range(reps):
        base, fast = run_pair(plain, spec, prompt, max_tokens)
        if result is None:
            result = TraceResult(name, len(prompt), len(base.token_ids))
        result.plain_tps.append(base.decode_tps)
        result.spec_tps.append(fast.decode_tps)
        result.identical &= base.token_ids == fast.token_ids
        if rep == 0:
            result.drafted, result.accepted = fast.drafted, fast.accepted
            result.decode_steps = fast.decode_steps
        if llama[0] is not None and llama[1] is not None:
            result.llama_tps.append(llama[0](prompt, max_tokens).decode_tps)
            result.llama_lookup_tps.append(llama[1](prompt, max_tokens).decode_tps)
        print(f"  {name} rep {rep + 1}/{reps}: plain {base.decode_tps:.1f} tok/s, "
              f"spec {fast.decode_tps:.1f} tok/s", flush=True)
    assert result is not None
    return result


def _fmt(value: Any, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'trace':<10} {'prompt':>6} {'out':>4} {'plain t/s':>9} {'spec t/s':>9} "
            f"{'speedup':>7} {'accept':>6} {'tok/step':>8} {'same@t0':>7} "
            f"{'llama t/s':>9} {'lookup t/s':>10} {'llama x':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['trace']:<10} {r['prompt_tokens']:>6} {r['completion_tokens']:>4} "
            f"{_fmt(r['plain_tok_s']):>9} {_fmt(r['spec_tok_s']):>9} "
            f"{_fmt(r['speedup'], '.2f'):>7} {_fmt(r['acceptance'], '.2f'):>6} "
            f"{_fmt(r['tokens_per_step'], '.2f'):>8} {_fmt(r['identical_at_t0']):>7} "
            f"{_fmt(r['llama_cpp_tok_s']):>9} {_fmt(r['llama_cpp_lookup_tok_s']):>10} "
            f"{_fmt(r['llama_cpp_speedup'], '.2f'):>7}")
    return "\n".join(lines)


def engines(loaded: LoadedModel, num_spec: int) -> tuple[Engine, Engine]:
    common: dict[str, Any] = {"enable_prefix_caching": False, "max_num_batched_tokens": 4096}
    plain = Engine(EngineConfig(**common), model=loaded)
    spec = Engine(EngineConfig(speculative="ngram", num_speculative_tokens=num_spec, **common),
                  model=loaded)
    return plain, spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run, scratch output")
    parser.add_argument("--threads", type=int, default=2, help="threads of every system")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per trace")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    max_tokens, reps = (96, 1) if args.quick else (400, args.reps)
    loaded = load_model()
    plain, spec = engines(loaded, args.num_speculative_tokens)
    llama: tuple[LlamaCpp | None, LlamaCpp | None] = (None, None)
    note = "skipped (--no-llama-cpp)"
    if not args.no_llama_cpp:
        p, lk, note = make_llama(args.threads, args.num_speculative_tokens)
        llama = (p, lk)
    rows = []
    for name, (messages, n) in traces(max_tokens).items():
        prompt = loaded.tokenizer.apply_chat_template(messages, None, add_generation_prompt=True)
        rows.append(run_trace(name, prompt, n, plain, spec, llama, reps).summary())
    table = format_table(rows)
    print(f"\ntorch threads {torch.get_num_threads()}, llama.cpp threads {args.threads}; "
          f"k={args.num_speculative_tokens}; median of {reps} rep(s); {note}")
    print(table)
    out = SCRATCH if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"rows": rows, "reps": reps, "max_tokens": max_tokens, "llama_cpp_note": note,
               "num_speculative_tokens": args.num_speculative_tokens,
               "machine": {"platform": platform.platform(), "threads": args.threads},
               "runs": [asdict(r) for r in []]}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
