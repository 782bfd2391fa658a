"""Per-op profile (torch.profiler) of decode steps of the engine.

Loads the default model at a weight format, prefills `--streams` ~300-token prompts, then
times `--steps` decode steps through `Engine.step()` (wall ms per step, without the profiler),
profiles as many again and prints the per-op table (self CPU time, sorted). Run it with the
thread count the benchmarks use:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_decode.py --quantization fp16 --threads 2
    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_decode.py --streams 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import Engine, EngineConfig, SamplingParams
from engine.config import KV_CACHE_DTYPES
from engine.linear import QUANTIZATIONS


def step_ms(engine: Engine, steps: int) -> float:
    """Median wall milliseconds of `steps` engine steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--quantization", default="fp16", choices=QUANTIZATIONS)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=22)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = EngineConfig(quantization=args.quantization, num_pages=64 * args.streams,
                          max_num_seqs=max(args.streams, 1), enable_prefix_caching=False,
                          kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine(config)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"Story {i}. " + "Tell me a long story about a robot. " * 35, params)
    for _ in range(8):  # prefill and warm up the decode path
        engine.step()
    median = step_ms(engine, args.steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(f"quantization={args.quantization} kv={args.kv_cache_dtype} threads={args.threads} "
          f"streams={args.streams} "
          f"steps={args.steps} median step {median:.1f} ms (unprofiled) "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
