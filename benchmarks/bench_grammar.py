"""Grammar-constrained decoding: llguidance vs xgrammar, and the mask's share of decode time.

Part 1, library comparison on this engine's own vocabulary (SmolLM2, 49152 byte-level tokens):
tokenizer setup, compile time of a tool-call JSON schema, and per-token mask + advance time
while both matchers follow the same valid document token by token (one thread each).

Part 2, overhead in the engine: decode TPOT with every sequence constrained (a JSON schema that
keeps the model generating) against the same batch unconstrained (stop tokens ignored), at
batch 1 and 8, interleaved runs, medians. The mask is filled in a worker thread during the
forward pass; `exposed` is the time a step still waits for it plus applying it to the logits,
measured separately on the same states. Target: <= 10% of TPOT.

    python benchmarks/bench_grammar.py [--quick] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.grammar import GrammarSpec, allocate_bitmask, apply_token_bitmask

RESULTS = Path(__file__).parent / "results" / "bench_grammar.json"
SCRATCH = Path(__file__).parent / "results" / "scratch" / "bench_grammar.json"
STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "search_orders"},
        "arguments": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"},
            "status": {"type": "string", "enum": ["open", "shipped", "returned"]},
            "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["query", "limit", "status", "tags"], "additionalProperties": False},
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
DOCUMENT = {"name": "search_orders", "arguments": {
    "query": "garden chairs delivered to the north warehouse last spring", "limit": 25,
    "status": "shipped", "tags": ["outdoor", "furniture", "priority", "bulk order"]}}
LONG_SCHEMA = {"type": "array", "minItems": 400, "items": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "n": {"type": "integer"}}, "required": ["city", "n"]}}
PROMPT = "List cities and numbers as JSON."


@dataclass(frozen=True)
class LibraryRow:
    library: str
    version: str
    tokenizer_setup_ms: float
    compile_ms: float
    mask_us_per_token: float
    advance_us_per_token: float
    tokens: int


@dataclass(frozen=True)
class OverheadRow:
    batch: int
    tpot_plain_ms: float
    tpot_constrained_ms: float
    overhead_pct: float
    exposed_mask_ms: float
    exposed_pct: float


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - start) * 1000.0


def bench_llguidance(engine: Engine, tokens: list[int]) -> LibraryRow:
    import llguidance

    compiler = engine.grammar
    _, setup = _timed(lambda: compiler.tokenizer)
    spec = GrammarSpec.json_schema({**CALL_SCHEMA, "x-guidance": STYLE})
    grammar, compile_ms = _timed(lambda: llguidance.LLMatcher(compiler.tokenizer,
                                                              spec.to_llguidance()))
    state = compiler.new_state(spec)
    bitmask = allocate_bitmask(1, engine.tokenizer.vocab_size)
    mask_s = advance_s = 0.0
    for token in tokens:
        t0 = time.perf_counter()
        state.fill_mask(bitmask, 0)
        t1 = time.perf_counter()
        assert state.accept(token), state.error
        advance_s += time.perf_counter() - t1
        mask_s += t1 - t0
    del grammar
    n = len(tokens)
    return LibraryRow("llguidance", llguidance.__version__, setup, compile_ms,
                      mask_s / n * 1e6, advance_s / n * 1e6, n)


def bench_xgrammar(engine: Engine, tokens: list[int]) -> LibraryRow | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    tok = engine.tokenizer
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    info, setup = _timed(lambda: xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size,
        stop_token_ids=sorted(tok.stop_token_ids)))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled, compile_ms = _timed(lambda: compiler.compile_json_schema(
        json.dumps(CALL_SCHEMA), any_whitespace=False, separators=(", ", ": ")))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    mask_s = advance_s = 0.0
    for token in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        t1 = time.perf_counter()
        assert matcher.accept_token(token), f"xgrammar rejected token {token}"
        advance_s += time.perf_counter() - t1
        mask_s += t1 - t0
    n = len(tokens)
    version = importlib.metadata.version("xgrammar")
    return LibraryRow("xgrammar", version, setup, compile_ms,
                      mask_s / n * 1e6, advance_s / n * 1e6, n)


def _decode_tpot(engine: Engine, batch: int, tokens: int, constrained: bool) -> float:
    schema = json.dumps(LONG_SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                            json_schema=schema)
    outs = engine.generate([f"{PROMPT} ({i})" for i in range(batch)], params)
    return statistics.median(o.tpot for o in outs) * 1000.0


def _exposed_mask_ms(engine: Engine, batch: int, steps: int) -> float:
    """Per step: the fill (which the forward pass hides; counted whole here, as an upper
    bound) plus applying the bitmask to [batch, V] logits."""
    spec = GrammarSpec.json_schema(json.dumps(LONG_SCHEMA))
    states = [engine.grammar.new_state(spec) for _ in range(batch)]
    doc = engine.tokenizer.encode(json.dumps([{"city": "Paris", "n": i} for i in range(60)]))
    logits = torch.randn(batch, engine.tokenizer.vocab_size)
    total = 0.0
    for token in doc[:steps]:
        t0 = time.perf_counter()
        masks = engine.grammar.start_masks(states)
        assert masks is not None
        apply_token_bitmask(logits, masks.result())
        total += time.perf_counter() - t0
        for state in states:
            assert state.accept(token), state.error
    return total / min(steps, len(doc)) * 1000.0


def bench_overhead(engine: Engine, batch: int, tokens: int, repeats: int) -> OverheadRow:
    plain, constrained = [], []
    for _ in range(repeats):  # interleaved, so load changes hit both alike
        plain.append(_decode_tpot(engine, batch, tokens, False))
        constrained.append(_decode_tpot(engine, batch, tokens, True))
    p, c = statistics.median(plain), statistics.median(constrained)
    exposed = _exposed_mask_ms(engine, batch, tokens)
    return OverheadRow(batch, p, c, (c - p) / p * 100.0, exposed, exposed / p * 100.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens; scratch output")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(num_pages=256))
    doc = json.dumps(DOCUMENT)
    tokens = engine.tokenizer.encode(doc) + sorted(engine.tokenizer.stop_token_ids)[:1]
    libs = [r for r in (bench_llguidance(engine, tokens[:-1]),
                        bench_xgrammar(engine, tokens[:-1])) if r is not None]
    print(f"library comparison ({len(tokens) - 1} tokens of a tool call, one thread)")
    print(f"{'library':<11} {'version':<8} {'setup ms':>9} {'compile ms':>10} "
          f"{'mask us/tok':>11} {'advance us/tok':>14}")
    for r in libs:
        print(f"{r.library:<11} {r.version:<8} {r.tokenizer_setup_ms:>9.1f} {r.compile_ms:>10.2f} "
              f"{r.mask_us_per_token:>11.1f} {r.advance_us_per_token:>14.1f}")
    n_tokens, repeats = (12, 1) if args.quick else (24, 2)
    rows = [bench_overhead(engine, b, n_tokens, repeats) for b in (1, 8)]
    print(f"\nmask overhead per decode step (llguidance, {n_tokens} tokens, {repeats} runs, "
          f"{args.threads} threads)")
    print(f"{'batch':>5} {'TPOT plain ms':>13} {'TPOT constrained ms':>19} {'overhead':>9} "
          f"{'exposed mask ms':>15} {'exposed':>8}")
    for r in rows:
        print(f"{r.batch:>5} {r.tpot_plain_ms:>13.2f} {r.tpot_constrained_ms:>19.2f} "
              f"{r.overhead_pct:>8.1f}% {r.exposed_mask_ms:>15.3f} {r.exposed_pct:>7.1f}%")
    out = SCRATCH if args.quick else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    out.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "loadavg": load, "libraries": [asdict(r) for r in libs],
        "overhead": [asdict(r) for r in rows]}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
