"""Per-op profile (torch.profiler) of single-stream decode steps of the engine.

Loads the default model at a weight format, prefills a ~300-token prompt, then profiles
`--steps` batch-1 decode steps through `Engine.step()` and prints the per-op table
(self CPU time, sorted). Run it with the thread count the benchmarks use:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_decode.py --quantization fp16 --threads 2
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from engine import Engine, EngineConfig, SamplingParams
from engine.linear import QUANTIZATIONS


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--quantization", default="fp16", choices=QUANTIZATIONS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=22)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(quantization=args.quantization, num_pages=64))
    prompt = "Tell me a long story about a robot who learns to paint. " * 25
    engine.add_request(prompt, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    for _ in range(8):  # prefill and warm up the decode path
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(f"quantization={args.quantization} threads={args.threads} steps={args.steps}")
    print(table)


if __name__ == "__main__":
    main()
