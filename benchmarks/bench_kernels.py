"""Benchmark the kernels: Triton vs the torch path vs SDPA over gathered pages (CUDA), and
the torch path alone at the engine's shapes (CPU).

On a CUDA device every Triton kernel is timed with CUDA events next to its torch reference,
attention also next to ``scaled_dot_product_attention`` over pages gathered per call, and the
decode kernel's achieved bandwidth (K/V + q read, output written, per second) is reported as
a fraction of a device-to-device copy measured in the same run. Targets (H200): decode at
batch 64 / 4k context >= 60% of copy bandwidth and >= 2x gathered SDPA.

Without CUDA it says so, then times the CPU torch path (the engine's CPU runtime path) at the
engine's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, page size 16).

Run: ``.venv/bin/python benchmarks/bench_kernels.py [--quick] [--threads N]``; writes
``benchmarks/results/bench_kernels.json`` (CUDA) or ``bench_kernels_cpu.json`` (CPU table).
Every Triton row also records its largest difference from the torch path (``max_abs_err``),
so a GPU run doubles as a correctness check of the compiled kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from kernels_workloads import (
    ENGINE,
    LLAMA8B,
    AttnShape,
    decode_bytes,
    gathered_sdpa_decode,
    gathered_sdpa_prefill,
    make_inputs,
)
from tqdm import tqdm

import paged_kernels
from paged_kernels import torch_attention

RESULTS = Path(__file__).resolve().parent / "results"
DECODE_BW_TARGET = 0.60  # fraction of copy bandwidth
DECODE_SDPA_TARGET = 2.0  # speedup over gathered SDPA


@dataclass(frozen=True)
class Row:
    """One benchmark line: times in ms per call; ratios relative to the first column."""

    op: str
    shape: str
    impl: str
    ms: float
    speedup_vs_torch: float | None = None
    gbps: float | None = None
    frac_of_copy: float | None = None
    max_abs_err: float | None = None


# ---------------------------------------------------------------- timing


def time_cuda(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median ms per call over ``iters`` calls, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    """Median ms per call (wall clock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


Timer = Callable[[Callable[[], object]], float]  # fn -> ms per call


def copy_bandwidth_gbps(device: torch.device, timer: Timer, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of ``nbytes``: bytes read + bytes written per second, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------- CUDA suite


def bench_decode(
    shape: AttnShape, dtype: torch.dtype, device: torch.device, timer: Timer, copy_gbps: float
) -> list[Row]:
    x = make_inputs(shape, dtype, device)
    args = (x.q, x.k_cache, x.v_cache, x.block_table, x.seq_lens, x.scale)
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "torch": lambda: paged_kernels.paged_decode_attention(*args, backend="torch"),
        "sdpa_gathered": lambda: gathered_sdpa_decode(x),
        "triton": lambda: paged_kernels.paged_decode_attention(*args, backend="triton"),
    }
    reference = impls["torch"]().float()
    nbytes = decode_bytes(shape, x.q.element_size())
    rows, torch_ms = [], 0.0
    for impl, fn in impls.items():
        ms = timer(fn)
        torch_ms = ms if impl == "torch" else torch_ms
        gbps = nbytes / (ms * 1e-3) / 1e9
        err = (fn().float() - reference).abs().max().item()
        rows.append(Row("decode", shape.name, impl, ms, torch_ms / ms, gbps, gbps / copy_gbps, err))
    return rows


def bench_prefill(
    shape: AttnShape, dtype: torch.dtype, device: torch.device, timer: Timer
) -> list[Row]:
    x = make_inputs(shape, dtype, device)
    args = (x.q, x.k_cache, x.v_cache, x.block_table, x.cu_seqlens_q, x.seq_lens, x.scale)
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "torch": lambda: paged_kernels.paged_prefill_attention(*args, backend="torch"),
        "sdpa_gathered": lambda: gathered_sdpa_prefill(x, shape),
        "triton": lambda: paged_kernels.paged_prefill_attention(*args, backend="triton"),
    }
    reference = impls["torch"]().float()
    rows, torch_ms = [], 0.0
    for impl, fn in impls.items():
        ms = timer(fn)
        torch_ms = ms if impl == "torch" else torch_ms
        err = (fn().float() - reference).abs().max().item()
        rows.append(Row("prefill", shape.name, impl, ms, torch_ms / ms, max_abs_err=err))
    return rows


def small_op_cases(
    tokens: int, dtype: torch.dtype, dev: torch.device
) -> dict[str, Callable[[str], object]]:
    """The per-token ops at the engine's widths, each taking a backend name."""
    hidden, inter, heads, kv_heads, head_dim = 576, 1536, 9, 3, 64
    x = torch.randn(tokens, hidden, dtype=dtype, device=dev)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=dtype, device=dev)
    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=dev)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=dev)
    pos = torch.arange(tokens, device=dev) % 4096
    cache = paged_kernels.rotary_cache(4096, head_dim, 100000.0).to(dev)
    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=dev)
    k_cache = torch.zeros(tokens // 16 + 1, 16, kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(tokens, device=dev)
    return {
        "rms_norm": lambda b: paged_kernels.rms_norm(x, w, 1e-5, backend=b),
        "rms_norm+residual": lambda b: paged_kernels.rms_norm(x, w, 1e-5, residual=res, backend=b),
        "rotary": lambda b: paged_kernels.rotary(q, k, pos, cache, backend=b),
        "silu_and_mul": lambda b: paged_kernels.silu_and_mul(gate_up, backend=b),
        "store_kv": lambda b: paged_kernels.store_kv(k, k, k_cache, v_cache, slots, backend=b),
    }


def max_abs_diff(a: object, b: object) -> float | None:
    """Largest elementwise difference of two op results (tensors or tuples of them)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, tuple) and isinstance(b, tuple):
        diffs = [max_abs_diff(x, y) for x, y in zip(a, b, strict=True)]
        return max(d for d in diffs if d is not None)
    return None  # in-place ops (store_kv)


def bench_small_ops(
    tokens: int, dtype: torch.dtype, device: torch.device, timer: Timer
) -> list[Row]:
    rows = []
    for name, fn in small_op_cases(tokens, dtype, device).items():
        torch_ms = timer(lambda fn=fn: fn("torch"))
        triton_ms = timer(lambda fn=fn: fn("triton"))
        err = max_abs_diff(fn("triton"), fn("torch"))
        rows.append(Row(name, f"T={tokens}", "torch", torch_ms, 1.0))
        rows.append(Row(name, f"T={tokens}", "triton", triton_ms, torch_ms / triton_ms,
                        max_abs_err=err))
    return rows


def cuda_shapes(quick: bool) -> tuple[list[AttnShape], list[AttnShape]]:
    decode = [
        AttnShape("smollm2 b64 ctx4096", batch=64, context=4096, **ENGINE),
        AttnShape("llama8b b64 ctx4096", batch=64, context=4096, **LLAMA8B),
    ]
    prefill = [AttnShape("smollm2 512 new, 2k prefix", batch=1, context=2560, new_tokens=512,
                         **ENGINE)]
    if not quick:
        decode += [
            AttnShape("smollm2 b1 ctx4096", batch=1, context=4096, **ENGINE),
            AttnShape("smollm2 b64 ctx512", batch=64, context=512, **ENGINE),
            AttnShape("llama8b b8 ctx16384", batch=8, context=16384, **LLAMA8B),
        ]
        prefill += [
            AttnShape("smollm2 512 new, no prefix", batch=1, context=512, new_tokens=512,
                      **ENGINE),
            AttnShape("smollm2 4x512 new, 1k prefix", batch=4, context=1536, new_tokens=512,
                      **ENGINE),
            AttnShape("llama8b 2048 new, 2k prefix", batch=1, context=4096, new_tokens=2048,
                      **LLAMA8B),
        ]
    return decode, prefill


def run_suite(
    decode_shapes: list[AttnShape],
    prefill_shapes: list[AttnShape],
    op_tokens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    copy_gbps: float,
) -> list[Row]:
    """Every kernel next to its baselines; device and timer are parameters so the suite can
    be dry-run on CPU under the Triton interpreter."""
    rows: list[Row] = []
    for shape in tqdm(decode_shapes, desc="decode"):
        rows += bench_decode(shape, dtype, device, timer, copy_gbps)
    for shape in tqdm(prefill_shapes, desc="prefill"):
        rows += bench_prefill(shape, dtype, device, timer)
    for tokens in tqdm(op_tokens, desc="small ops"):
        rows += bench_small_ops(tokens, dtype, device, timer)
    return rows


def run_cuda(quick: bool, dtype: torch.dtype) -> dict[str, object]:
    device = torch.device("cuda")
    iters = 10 if quick else 50

    def timer(fn: Callable[[], object]) -> float:
        return time_cuda(fn, iters)

    copy_gbps = copy_bandwidth_gbps(device, timer)
    decode_shapes, prefill_shapes = cuda_shapes(quick)
    op_tokens = [64] if quick else [64, 4096]
    rows = run_suite(decode_shapes, prefill_shapes, op_tokens, dtype, device, timer, copy_gbps)
    return {
        "device": torch.cuda.get_device_name(),
        "dtype": str(dtype),
        "copy_gbps": copy_gbps,
        "rows": [asdict(r) for r in rows],
        "targets": decode_targets(rows),
    }


def decode_targets(rows: list[Row]) -> dict[str, object]:
    """The issue's decode targets on the batch-64, 4k-context engine and Llama shapes.

    The SDPA baseline is the faster of the two gathered-pages paths: plain gather + SDPA
    with ``enable_gqa``, and the torch path (gather + SDPA with GQA folded into the queries).
    """
    out: dict[str, object] = {}
    for shape in ("smollm2 b64 ctx4096", "llama8b b64 ctx4096"):
        by_impl = {r.impl: r for r in rows if r.op == "decode" and r.shape == shape}
        if "triton" not in by_impl:
            continue
        tri = by_impl["triton"]
        baseline_ms = min(by_impl["sdpa_gathered"].ms, by_impl["torch"].ms)
        frac, speedup = tri.frac_of_copy or 0.0, baseline_ms / tri.ms
        out[shape] = {
            "frac_of_copy": frac,
            "speedup_vs_gathered_sdpa": speedup,
            "met": frac >= DECODE_BW_TARGET and speedup >= DECODE_SDPA_TARGET,
        }
    return out


# ---------------------------------------------------------------- CPU table


def cpu_shapes(quick: bool) -> tuple[list[AttnShape], list[AttnShape]]:
    pairs = [(1, 512), (8, 2048)] if quick else [
        (1, 512), (1, 4096), (8, 2048), (16, 4096), (64, 512), (64, 2048), (64, 4096)
    ]
    decode = [AttnShape(f"b{b} ctx{c}", batch=b, context=c, **ENGINE) for b, c in pairs]
    chunks = [(64, 1024), (512, 512)] if quick else [(64, 1024), (512, 512), (512, 2560)]
    prefill = [AttnShape(f"{n} new of {c}", batch=1, context=c, new_tokens=n, **ENGINE)
               for n, c in chunks]
    return decode, prefill


def run_cpu(quick: bool) -> dict[str, object]:
    iters = 3 if quick else 7
    decode_shapes, prefill_shapes = cpu_shapes(quick)
    rows: list[Row] = []
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        for shape in tqdm(decode_shapes, desc=f"cpu decode {dtype}"):
            x = make_inputs(shape, dtype, cpu)
            ms = time_cpu(lambda x=x: torch_attention.paged_decode_attention(
                x.q, x.k_cache, x.v_cache, x.block_table, x.seq_lens, x.scale), iters)
            gbps = decode_bytes(shape, x.q.element_size()) / (ms * 1e-3) / 1e9
            rows.append(Row("decode", shape.name, f"torch {dtype}", ms, gbps=gbps))
        for shape in tqdm(prefill_shapes, desc=f"cpu prefill {dtype}"):
            x = make_inputs(shape, dtype, cpu)
            ms = time_cpu(lambda x=x: torch_attention.paged_prefill_attention(
                x.q, x.k_cache, x.v_cache, x.block_table, x.cu_seqlens_q, x.seq_lens, x.scale),
                iters)
            rows.append(Row("prefill", shape.name, f"torch {dtype}", ms))
    torch_attention.release_workspace()
    return {"device": "cpu", "threads": torch.get_num_threads(), "rows": [asdict(r) for r in rows]}


# ---------------------------------------------------------------- output


def print_table(rows: list[dict[str, object]]) -> None:
    head = (f"{'op':<18} {'shape':<30} {'impl':<22} {'ms':>9} {'x torch':>8} {'GB/s':>8} "
            f"{'of copy':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        def fmt(v: object, spec: str) -> str:
            return format(v, spec) if isinstance(v, float) else "-"

        print(f"{r['op']:<18} {r['shape']:<30} {r['impl']:<22} {fmt(r['ms'], '9.3f')} "
              f"{fmt(r['speedup_vs_torch'], '8.2f')} {fmt(r['gbps'], '8.1f')} "
              f"{fmt(r['frac_of_copy'], '8.1%')}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes, few iterations")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                        help="CUDA input dtype")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU table: torch.set_num_threads for this run (0 = torch's default)")
    parser.add_argument("--no-cpu-table", action="store_true",
                        help="without CUDA, skip the CPU torch-path timings too")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/, or /tmp with --quick)")
    return parser.parse_args(argv)


def _out_path(args: argparse.Namespace, name: str) -> Path:
    """--out, else the committed results (full runs) or a scratch file (--quick)."""
    if args.out is not None:
        out: Path = args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        return out
    return Path("/tmp") / f"quick_{name}" if args.quick else RESULTS / name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        result = run_cuda(args.quick, getattr(torch, args.dtype))
        print(f"device {result['device']}, copy bandwidth {result['copy_gbps']:.0f} GB/s")
        path = _out_path(args, "bench_kernels.json")
    else:
        print("no CUDA device present: the Triton kernels are not benchmarked on this machine")
        if args.no_cpu_table:
            return 0
        print("timing the CPU torch path (the engine's CPU runtime path) at the engine's shapes")
        if args.threads:
            torch.set_num_threads(args.threads)
        result = run_cpu(args.quick)
        path = _out_path(args, "bench_kernels_cpu.json")
    print_table(result["rows"])  # type: ignore[arg-type]
    if "targets" in result:
        print("decode targets:", json.dumps(result["targets"], indent=1))
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
