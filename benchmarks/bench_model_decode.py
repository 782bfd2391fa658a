"""Single-stream decode speed of the engine's model for each weight format, side by side.

For fp32, bf16 and fp16 (fbgemm: fp16 weights, fp32 math) this measures the paged decode step
(T=1, batch 1) at a fixed context, the weight bytes one step streams, and accuracy against
fp32: the largest logit difference over a few prompts and whether greedy continuations match.

    .venv/bin/python benchmarks/bench_model_decode.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from engine.attention_metadata import AttentionMetadata
from engine.gguf import read_gguf
from engine.loader import default_model_path
from engine.model import LlamaModel
from engine.tokenizer import Tokenizer

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three colours of the rainbow.",
    "Explain in one sentence why the sky is blue.",
)
PAGE_SIZE = 16
RESULTS = Path(__file__).parent / "results" / "model_decode.json"


class Row(NamedTuple):
    option: str
    ms_per_token: float  # median over rounds
    best_ms: float  # fastest round
    cpu_ms: float  # median process CPU time per token / threads (robust to a shared machine)
    streamed_mb: float
    max_logit_diff: float
    greedy_equal: str


class PagedRunner:
    """Runs one sequence through the paged model with a contiguous page table."""

    def __init__(self, model: LlamaModel, max_tokens: int) -> None:
        c = model.config
        pages = -(-max_tokens // PAGE_SIZE)
        shape = (pages, PAGE_SIZE, c.num_kv_heads, c.head_dim)
        cache_dtype = model.dtype
        self.model = model
        self.k = [torch.zeros(shape, dtype=cache_dtype) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=cache_dtype) for _ in range(c.num_layers)]
        self.table = torch.arange(pages, dtype=torch.int32)[None]

    def step(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits [len(ids), vocab] for tokens at positions start.. (cache holds 0..start)."""
        n = len(ids)
        positions = torch.arange(start, start + n)
        meta = AttentionMetadata(
            slot_mapping=positions,
            block_table=self.table,
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            is_decode=n == 1,
        )
        hidden = self.model(torch.tensor(ids), positions, meta, self.k, self.v)
        return self.model.compute_logits(hidden)


@torch.inference_mode()
def greedy(model: LlamaModel, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    runner = PagedRunner(model, len(prompt) + new_tokens)
    logits = runner.step(prompt, 0)
    first = logits[-1]
    out = [int(first.argmax())]
    for i in range(new_tokens - 1):
        out.append(int(runner.step(out[-1:], len(prompt) + i)[-1].argmax()))
    return out, first


@torch.inference_mode()
def decode_rounds(
    models: dict[str, LlamaModel], context: int, steps: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU ms/token per option, in interleaved rounds so machine noise hits all alike.

    CPU time is the process's CPU time divided by the torch thread count: on a machine shared
    with other jobs it leaves out the time this process waited for a core.
    """
    runners = {name: PagedRunner(m, context + rounds * steps + 8) for name, m in models.items()}
    for runner in runners.values():
        runner.step([11] * context, 0)
        runner.step([11], context)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}
    threads = torch.get_num_threads()
    for r in tqdm(range(rounds), desc="decode rounds"):
        for name, runner in runners.items():
            start = context + 1 + r * steps
            begin, cpu_begin = time.perf_counter(), time.process_time()
            for i in range(steps):
                runner.step([11], start + i)
            times[name].append((time.perf_counter() - begin) / steps * 1e3)
            cpu[name].append((time.process_time() - cpu_begin) / steps / threads * 1e3)
    return times, cpu


def build(option: str, weights: dict[str, torch.Tensor], config: object) -> LlamaModel:
    dtype = torch.bfloat16 if option == "bf16" else torch.float32
    model = LlamaModel(config, dtype=dtype)  # type: ignore[arg-type]
    model.load_weights(weights)
    if option == "fp16":
        model.quantize(option)  # type: ignore[arg-type]
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and prompts")
    parser.add_argument("--context", type=int, default=128, help="tokens in the cache")
    parser.add_argument("--options", default="fp32,bf16,fp16")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, new_tokens, rounds = (5, 8, 3) if args.quick else (10, 24, 7)
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    contents = read_gguf(default_model_path())
    tokenizer = Tokenizer(contents.tokenizer)
    encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    options = args.options.split(",")
    models = {o: build(o, contents.weights, contents.config) for o in tqdm(options, desc="build")}
    times, cpu = decode_rounds(models, args.context, steps, rounds)
    reference: list[tuple[list[int], torch.Tensor]] = []
    rows: list[Row] = []
    for option, model in tqdm(models.items(), desc="accuracy"):
        runs = [greedy(model, ids, new_tokens) for ids in encoded]
        if not reference:
            reference = runs
        diff = max(float((r[1] - o[1]).abs().max()) for r, o in zip(reference, runs, strict=True))
        same = sum(r[0] == o[0] for r, o in zip(reference, runs, strict=True))
        mb = model.streamed_weight_bytes() / 1e6
        ms, cpu_ms = sorted(times[option]), sorted(cpu[option])
        rows.append(
            Row(option, ms[len(ms) // 2], ms[0], cpu_ms[len(ms) // 2], mb, diff,
                f"{same}/{len(runs)}")
        )
    threads = torch.get_num_threads()
    print(f"\nsingle-stream decode, context {args.context}, torch threads {threads}")
    print(f"{'option':<8}{'median ms':>10}{'best ms':>9}{'cpu ms':>8}{'MB/step':>9}"
          f"{'max|dlogit|':>13}{'greedy==ref':>13}")
    for r in rows:
        print(f"{r.option:<8}{r.ms_per_token:>10.1f}{r.best_ms:>9.1f}{r.cpu_ms:>8.1f}"
              f"{r.streamed_mb:>9.0f}{r.max_logit_diff:>13.3f}{r.greedy_equal:>13}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {"context": args.context, "threads": torch.get_num_threads(), "rounds": rounds,
               "reference": rows[0].option, "rows": [r._asdict() for r in rows]}
    RESULTS.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
