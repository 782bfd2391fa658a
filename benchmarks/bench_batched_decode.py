"""Batched decode per native code path: AVX2 float panels, AVX-512 float tiles and AVX-512 BF16
dot products, side by side.

Decode steps of two or more sequences are bound by their products' multiply-adds (each weight
block is dequantized once and used by every row), not by weight bytes as one stream is. This
benchmark runs the int4 engine (the GGUF's Q4_1 weights, float16 KV cache, greedy, 128 new
tokens after 32-token prompts) at 1, 4 and 8 concurrent streams under each code path the CPU
runs, in six rounds (every path and stream count once per round, the stream counts in
alternating order, after one untimed run per path: this VM's clock drifts by tens of percent
within a minute, so a ratio is the median of the rounds' own ratios), then times the products
alone at 8 activation rows on the model's shapes.
Each path is selected as a user would (`PREFIXGATE_NATIVE_GEMM=avx2`, `=avx512`, or the default)
before its model and engines are built. Same thread count everywhere (`--threads`, default 2).

    PYTHONPATH=$PWD python benchmarks/bench_batched_decode.py [--quick] [--threads N]

Prints a table and writes benchmarks/results/batched_decode.json (--quick: a scratch file).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.engine_rows import best_seconds, engine_decode, round_order  # noqa: E402
from engine.loader import LoadedModel, load_model  # noqa: E402
from engine.native import native_gemm  # noqa: E402
from engine.native.block_gemm import BlockGemm, bind  # noqa: E402
from engine.quant_blocks import quantize_q4_1, quantize_q8_0  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "batched_decode.json"
QUICK_RESULTS = ROOT / "benchmarks" / "results" / "batched_decode.quick.json"
STREAMS = (1, 4, 8)
# SmolLM2-135M's products: (name, out, in, grid)
PRODUCTS = (("qkv", 960, 576, "q4_1"), ("gate_up", 3072, 576, "q4_1"),
            ("down", 576, 1536, "q4_1"), ("lm_head", 49152, 576, "q8_0"))


@contextlib.contextmanager
def code_path(mode: str) -> Iterator[None]:
    """`PREFIXGATE_NATIVE_GEMM=mode` while models and engines are built."""
    before = os.environ.get("PREFIXGATE_NATIVE_GEMM")
    os.environ["PREFIXGATE_NATIVE_GEMM"] = mode
    native_gemm.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PREFIXGATE_NATIVE_GEMM")
        else:
            os.environ["PREFIXGATE_NATIVE_GEMM"] = before
        native_gemm.cache_clear()


def paths() -> dict[str, str]:
    """Code path name -> PREFIXGATE_NATIVE_GEMM mode, for the paths this CPU runs."""
    with code_path("auto"):
        best = native_gemm()
    if best is None or not best.avx2:
        raise SystemExit("needs the native library with AVX2")
    found = {"avx2": "avx2"}
    if best.avx512:
        found["avx512"] = "avx512"
    if best.bf16:
        found["avx512bf16"] = "auto"
    return found


def product_ms(gemm: BlockGemm, threads: int, rows: int, repeats: int) -> dict[str, float]:
    """Milliseconds per product at `rows` activation rows, best of `repeats` (warm cache)."""
    out = {}
    for name, n, k, grid in PRODUCTS:
        g = torch.Generator().manual_seed(n + k)
        w = torch.randn(n, k, generator=g) * 0.05
        bound = bind(quantize_q4_1(w) if grid == "q4_1" else quantize_q8_0(w))
        x = torch.randn(rows, k, generator=g)
        out[name] = best_seconds(functools.partial(gemm.matmul, bound, x, threads), repeats) * 1e3
    return out


def run(threads: int, tokens: int, rounds: int, repeats: int) -> dict[str, object]:
    modes = paths()
    models: dict[str, LoadedModel] = {}
    gemms: dict[str, BlockGemm] = {}
    for path, mode in modes.items():
        with code_path(mode):
            models[path] = load_model(None, quantization="int4")
            gemm = native_gemm()
            assert gemm is not None
            gemms[path] = gemm
    rates: dict[str, dict[int, list[float]]] = {p: {s: [] for s in STREAMS} for p in modes}
    products: dict[str, list[dict[str, float]]] = {p: [] for p in modes}
    for path, mode in modes.items():  # untimed: the machine's clock ramps up under load
        with code_path(mode):
            engine_decode(models[path], STREAMS[-1], tokens, "float16")
    for i in tqdm(range(rounds), desc="rounds"):
        order = round_order(STREAMS, i)
        for path, mode in modes.items():
            with code_path(mode):
                for streams in order:
                    rates[path][streams].append(engine_decode(models[path], streams, tokens,
                                                              "float16"))
    # after the decode rounds: timed between them, the products slowed the next path's one
    # stream by 10-15% (its ratio to 8 streams then looked better than it is)
    for _ in range(rounds):
        for path in modes:
            products[path].append(product_ms(gemms[path], threads, 8, repeats))
    return {"threads": threads, "tokens": tokens, "rounds": rounds, "paths": list(modes),
            "rates": rates, "products_ms_8_rows": {
                p: {name: statistics.median(r[name] for r in runs) for name, *_ in PRODUCTS}
                for p, runs in products.items()}}


def _paired(values: list[float], bases: list[float]) -> float:
    return statistics.median(v / b for v, b in zip(values, bases, strict=True))


def table(report: dict[str, object]) -> str:
    rates = report["rates"]
    assert isinstance(rates, dict)
    lines = [f"{'path':10s} {'streams':>7s} {'tok/s':>8s} {'x one stream':>13s} {'x avx2':>7s}"]
    for path, by_streams in rates.items():
        for streams in STREAMS:
            values = by_streams[streams]
            vs_avx2 = _paired(values, rates["avx2"][streams])
            lines.append(f"{path:10s} {streams:7d} {statistics.median(values):8.1f} "
                         f"{_paired(values, by_streams[1]):12.2f}x {vs_avx2:6.2f}x")
    products = report["products_ms_8_rows"]
    assert isinstance(products, dict)
    lines.append("")
    lines.append(f"{'product at 8 rows':18s} " + " ".join(f"{p:>10s}" for p in products))
    for name, *_ in PRODUCTS:
        lines.append(f"{name:18s} " + " ".join(f"{products[p][name]:8.3f}ms" for p in products))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two rounds, 16 tokens, scratch JSON")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = run(args.threads, tokens=16 if args.quick else 128, rounds=2 if args.quick else 6,
                 repeats=10 if args.quick else 50)
    report["quick"] = args.quick
    report["cpu"] = _cpu_name()
    text = table(report)
    report["table"] = text
    print(text)
    out = QUICK_RESULTS if args.quick else RESULTS
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
