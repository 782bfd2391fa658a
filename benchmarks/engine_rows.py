"""Micro rows of benchmarks/bench_engine.py: decode TPOT per weight format beside its
bandwidth floor, 1/4/8-stream decode throughput, and cold prefill at 1k/4k/8k tokens, each for
the engine and, when `llama-cpp-python` is installed, llama.cpp on the same GGUF and token ids.

llama.cpp runs through its Python binding, which drives one sequence at a time: its 4- and
8-stream rows are sequential streams (llama-server would batch them; the binding does not).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.loader import LoadedModel, default_model_path
from engine.native import native_gemm
from engine.native.block_gemm import bind
from engine.quant_blocks import quantize_q4_1

LLAMA_CPP_MISSING = "not installed (optional bench extra: pip install -e '.[bench]')"


@dataclass
class Row:
    """One measured row: the engine's number beside llama.cpp's (None = not measured)."""

    measure: str
    unit: str
    engine: float
    llama_cpp: float | None = None
    floor: float | None = None  # bandwidth floor (ms) for TPOT rows
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """How many times better the engine is (time units: lower is better)."""
        if self.llama_cpp is None or not self.engine:
            return None
        if self.unit in ("ms/token",):
            return self.llama_cpp / self.engine
        return self.engine / self.llama_cpp


def report(row: Row) -> Row:
    """Print a measured row at once (long runs show progress) and return it."""
    ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
    print(f"  {row.measure}: engine {row.engine:.1f} {row.unit}, llama.cpp {row.llama_cpp}, "
          f"{ratio} {row.note}", flush=True)  # fmt: skip
    return row


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a large tensor copy, best of `repeats`."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


class ProductRate(NamedTuple):
    """The multiply-add rate (FLOP/s) a batched decode step's products reach, and by what."""

    flops: float
    source: str


def product_rate(threads: int, shape: tuple[int, int], rows: int = 8, repeats: int = 50
                 ) -> ProductRate:
    """What the projections of a `rows`-sequence decode step can reach at `threads` threads:
    the native float products (`engine/native/block_gemm.c`, `panels_avx512.c`,
    `tiles_bf16.c`: the kernels that step runs) on a Q4_1 weight of `shape` (out, in: the
    model's gate/up projection) times `rows` float32 rows, best of `repeats` with weights and
    rows in cache, so an upper bound for the step; torch's float32 product of the same shape
    where the native library is off."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w = torch.randn(rows, shape[1]), torch.randn(*shape)
        gemm = native_gemm()
        if gemm is not None:
            bound = bind(quantize_q4_1(w))

            def run() -> None:
                gemm.matmul(bound, x, threads)

            source = ("native AVX-512 BF16 tiles" if gemm.rounds_to_bf16(rows) else
                      "native AVX-512 fused tiles" if gemm.avx512 else "native float panels")
        else:

            def run() -> None:
                x @ w.T

            source = "torch float32"
        return ProductRate(2 * rows * w.numel() / best_seconds(run, repeats), source)
    finally:
        torch.set_num_threads(before)


def round_order(counts: tuple[int, ...], round_index: int) -> tuple[int, ...]:
    """The stream counts of round `round_index`, in alternating order (1 4 8, 8 4 1, ...), so
    that a drift in the machine's speed within a round hits the first and last count alike."""
    return counts if round_index % 2 == 0 else counts[::-1]


def best_seconds(run: Callable[[], object], repeats: int, warmup: int = 5) -> float:
    """The fastest of `repeats` timed calls of `run`, after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def token_flops(loaded: LoadedModel) -> int:
    """Multiply-add FLOPs of one token's projections and LM head (attention over a short
    context left out)."""
    c = loaded.config
    kv = c.num_kv_heads * c.head_dim
    layer = c.hidden_size * (c.num_heads * c.head_dim * 2 + 2 * kv) \
        + 3 * c.hidden_size * c.intermediate_size
    return 2 * (c.num_layers * layer + c.vocab_size * c.hidden_size)


def streamed_bytes(loaded: LoadedModel) -> int:
    """Weight bytes one decode step reads."""
    return int(loaded.model.streamed_weight_bytes())


def text_ids(loaded: LoadedModel, n: int, salt: int = 0) -> list[int]:
    """`n` token ids of ordinary English text (distinct per salt so no prefix is shared)."""
    words = "the quick brown fox reads a long report about river boats and mountain towns "
    ids = loaded.tokenizer.encode(f"Document {salt}. " + words * (n // 8 + 8))
    return ids[:n]


def _engine(loaded: LoadedModel, pages: int, seqs: int = 8, budget: int = 512,
            kv: str = "auto") -> Engine:
    config = EngineConfig(num_pages=pages, max_num_seqs=seqs, enable_prefix_caching=False,
                          max_num_batched_tokens=budget, kv_cache_dtype=kv)  # type: ignore[arg-type]
    return Engine(config, model=loaded)


def kv_for(loaded: LoadedModel, kv: str) -> str:
    """`kv` where the weight format allows it (a float16 cache needs float32 activations)."""
    return kv if loaded.model.dtype == torch.float32 else "auto"


def engine_decode(loaded: LoadedModel, streams: int, tokens: int, kv: str = "auto") -> float:
    """Aggregate decode tokens/s of `streams` concurrent greedy streams (32-token prompts)."""
    eng = _engine(loaded, pages=streams * (-(-(32 + tokens) // 16)) + 8, kv=kv_for(loaded, kv))
    eng.generate([text_ids(loaded, 8, 99)], SamplingParams(max_tokens=4, temperature=0.0))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = eng.generate([text_ids(loaded, 32, i) for i in range(streams)], params)
    return sum(1.0 / o.tpot for o in outs)


def engine_prefill(loaded: LoadedModel, n: int, kv: str = "auto") -> float:
    """Cold prefill tokens/s of one `n`-token prompt (time to first token)."""
    eng = _engine(loaded, pages=-(-(n + 16) // 16) + 4, seqs=1, kv=kv_for(loaded, kv))
    eng.generate([text_ids(loaded, 16, 98)], SamplingParams(max_tokens=1, temperature=0.0))
    out = eng.generate([text_ids(loaded, n, 1)], SamplingParams(max_tokens=1, temperature=0.0))
    return n / out[0].ttft


class LlamaCpp:
    """llama.cpp on the default GGUF through llama-cpp-python, `threads` threads."""

    def __init__(self, threads: int, n_ctx: int = 8192) -> None:
        import llama_cpp

        self.llm: Any = llama_cpp.Llama(
            str(default_model_path()), n_ctx=n_ctx, n_threads=threads,
            n_threads_batch=threads, n_batch=512, verbose=False,
        )  # fmt: skip

    def tpot(self, prompt: list[int], tokens: int) -> float:
        """Mean seconds per generated token after the first (greedy, fresh context)."""
        self.llm.reset()
        times: list[float] = []
        for _ in self.llm.generate(prompt, temp=0.0):
            times.append(time.perf_counter())
            if len(times) == tokens:
                break
        return (times[-1] - times[0]) / max(len(times) - 1, 1)

    def prefill(self, ids: list[int]) -> float:
        """Cold prefill tokens/s of `ids`."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t0)


def open_llama_cpp(threads: int) -> tuple[LlamaCpp | None, str]:
    try:
        return LlamaCpp(threads), ""
    except ImportError:
        return None, LLAMA_CPP_MISSING


def decode_rows(
    variants: dict[str, LoadedModel], lcpp: LlamaCpp | None, tokens: int, kv: str = "auto",
    repeats: int = 5,
) -> list[Row]:
    """Single-stream TPOT per weight format beside its floor (weights / copy bandwidth).
    Every format and llama.cpp run `repeats` times in turn (A B C .. L, A B C .. L), each keeping
    its median; the note adds the median of the per-round ratios, in which a drift of the
    machine's load between rounds cancels (one run of 64 tokens moves +-15% here)."""
    bandwidth = copy_bandwidth()
    gguf_bytes = default_model_path().stat().st_size
    runs: dict[str, list[float]] = {name: [] for name in variants}
    llama: list[float] = []
    prompt: list[int] = []
    for _ in range(repeats):
        for name, loaded in variants.items():
            prompt = text_ids(loaded, 32, 7)
            runs[name].append(1.0 / engine_decode(loaded, 1, tokens, kv))
        if lcpp is not None:
            llama.append(lcpp.tpot(prompt, tokens))
    rows = []
    for name, loaded in variants.items():
        floor = streamed_bytes(loaded) / bandwidth
        rows.append(Row(f"decode TPOT, {name}", "ms/token", 1e3 * statistics.median(runs[name]),
                        floor=1e3 * floor,
                        note=f"{streamed_bytes(loaded) / 1e6:.0f} MB, copy "
                             f"{bandwidth / 1e9:.1f} GB/s; median of {repeats}"))  # fmt: skip
    if llama:
        lc = 1e3 * statistics.median(llama)
        lc_floor = 1e3 * gguf_bytes / bandwidth
        for row, name in zip(rows, variants, strict=True):
            paired = _paired(llama, runs[name])
            row.llama_cpp = lc
            row.note += (f"; paired {paired:.2f}x; llama.cpp floor {lc_floor:.1f} ms "
                         f"({gguf_bytes / 1e6:.0f} MB GGUF)")  # fmt: skip
    return [report(row) for row in rows]


def stream_rows(loaded: LoadedModel, lcpp: LlamaCpp | None, tokens: int,
                kv: str = "auto", repeats: int = 4) -> list[Row]:
    """1/4/8 concurrent decode streams: aggregate tokens/s (llama.cpp: sequential streams).
    `repeats` rounds, each running every stream count of the engine, then of llama.cpp, the
    counts in alternating order (1 4 8, 8 4 1), so that drift in the machine's speed (a shared
    VM's two vCPUs are not always two cores) hits every row of a round alike; each row's rate
    is its median, its ratio to one stream the median of the rounds' own ratios. The products'
    ceiling is timed after the rounds, once per round."""
    c = loaded.config
    shape, counts = (2 * c.intermediate_size, c.hidden_size), (1, 4, 8)
    rates: dict[int, list[float]] = {n: [] for n in counts}
    llama: dict[int, list[float]] = {n: [] for n in counts}
    ceilings: list[ProductRate] = []
    for i in range(repeats):
        order = round_order(counts, i)
        for streams in order:
            rates[streams].append(engine_decode(loaded, streams, tokens, kv))
        if lcpp is not None:
            for streams in order:
                llama[streams].append(1.0 / lcpp.tpot(text_ids(loaded, 32, streams), tokens))
    # after the rounds: timed between them, the products slowed the next round's one stream by
    # 10-15% (bench_batched_decode), which flattered the ratios to one stream
    for _ in range(repeats):
        ceilings.append(product_rate(torch.get_num_threads(), shape))
    ceiling = [r.flops / token_flops(loaded) for r in ceilings]
    ceiling_note = (f"; the products' ceiling {statistics.median(ceiling):.0f} tok/s = "
                    f"{_paired(ceiling, rates[1]):.2f}x one stream ({ceilings[0].source} at 8 "
                    "rows of the gate/up product: "
                    f"{statistics.median(r.flops for r in ceilings) / 1e9:.0f} GFLOP/s in cache, "
                    "timed once per round after the rounds)")
    rows = []
    for streams in counts:
        row = Row(f"decode, {streams} streams", "tok/s", statistics.median(rates[streams]),
                  note=f"{_paired(rates[streams], rates[1]):.2f}x one stream; "
                       f"median of {repeats} rounds")  # fmt: skip
        if streams > 1:  # batched steps are bound by multiply-adds, not by weight bytes
            row.note += ceiling_note
        if llama[streams]:
            row.llama_cpp = statistics.median(llama[streams])
            row.note += "; llama.cpp one at a time"
        rows.append(report(row))
    return rows


def _paired(values: list[float], bases: list[float]) -> float:
    """The median of values[i] / bases[i] (ratios within one round)."""
    return statistics.median(v / b for v, b in zip(values, bases, strict=True))


def prefill_rows(loaded: LoadedModel, lcpp: LlamaCpp | None, sizes: tuple[int, ...],
                 kv: str = "auto") -> list[Row]:
    """Cold prefill tokens/s of one prompt of each size, same token ids for both."""
    rows = []
    for n in sizes:
        row = Row(f"prefill {n} tokens", "tok/s", engine_prefill(loaded, n, kv))
        if lcpp is not None:
            row.llama_cpp = lcpp.prefill(text_ids(loaded, n, 1))
        rows.append(report(row))
    return rows


def engine_context_tpot(loaded: LoadedModel, prompt: list[int], tokens: int, kv: str) -> float:
    """Seconds per generated token after `prompt` (one greedy stream, cold cache)."""
    eng = _engine(loaded, pages=-(-(len(prompt) + tokens) // 16) + 4, seqs=1,
                  kv=kv_for(loaded, kv))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return eng.generate([prompt], params)[0].tpot


def context_rows(loaded: LoadedModel, lcpp: LlamaCpp | None, tokens: int,
                 contexts: tuple[int, ...]) -> list[Row]:
    """Decode TPOT after a long prompt (agents decode at the end of long contexts, where
    attention reads the whole KV cache every token), the engine's float32 and float16 caches
    beside llama.cpp (whose cache is float16), the same token ids."""
    rows = []
    for n in contexts:
        prompt = text_ids(loaded, n, 5)
        lc = 1e3 * lcpp.tpot(prompt, tokens) if lcpp is not None else None
        for kv, name in (("auto", "float32"), ("float16", "float16")):
            if kv_for(loaded, kv) != kv:
                continue
            tpot = engine_context_tpot(loaded, prompt, tokens, kv)
            rows.append(report(Row(f"decode TPOT after {n} tokens, KV {name}", "ms/token",
                                   1e3 * tpot, llama_cpp=lc, note="llama.cpp KV float16")))
    return rows


def format_rows(rows: list[Row]) -> str:
    head = (f"{'measure':<34} {'unit':>9} {'engine':>9} {'floor':>7} {'llama.cpp':>10} "
            f"{'ratio':>6}  note")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        floor = f"{r.floor:.1f}" if r.floor is not None else "-"
        lc = f"{r.llama_cpp:.1f}" if r.llama_cpp is not None else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        lines.append(f"{r.measure:<34} {r.unit:>9} {r.engine:>9.1f} {floor:>7} {lc:>10} "
                     f"{ratio:>6}  {r.note}")  # fmt: skip
    return "\n".join(lines)
