"""Decode steps of a block-quantized model in one native call (`engine/native/decode_step.c`).

At one new token per sequence a layer's norms, rotary, KV store, attention and SiLU are tiny,
and a 30-layer step runs about 300 of them; run one by one from Python each costs more in
dispatch than in arithmetic. `NativeDecoder` hands a whole decode step (every layer, then the
final norm) to C: one OpenMP region with the products split by output rows and attention by
(token, query head). Same weights and activation rounding as the per-op path
(`engine.native_linear`), except that on a CPU with AVX-512 BF16 the products of steps of 5-8
sequences (and their LM head, a `Q8_0Linear` call on the result) round activations and
weights to bfloat16 (`engine/native/tiles_bf16.c`, 1.3-1.4x the 8-stream decode): batched
decode is where a step is bound by multiply-adds. The model's own products (prefill chunks,
verify steps, the op-by-op path) stay float32, so a prefix-cache hit or a speculative verify
computes what a cold prefill or a plain step would. `PREFIXGATE_NATIVE_GEMM=avx512` keeps every
product float32.

It serves decode steps (one new token per sequence) of up to `MAX_DECODE_ROWS` sequences of a
float32 CPU model whose projections are all native blocks (`quantization="int8"`/`"int4"`), over
a float32 or float16 KV cache (K and V rounded to the nearest half when stored, as the torch
path's `.to(torch.float16)`);
`ModelRunner` falls back to `LlamaModel.forward` for anything else (prefill, verify steps,
large batches, fp16/none, no compiler). `PREFIXGATE_NATIVE_STEP=off` turns it off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import profiler

from engine.attention_metadata import AttentionMetadata
from engine.model import PROJECTIONS, LlamaModel
from engine.native import BlockGemm, native_gemm
from engine.native.block_gemm import NEED_WORKSPACE, check_status
from engine.native_linear import FLOAT_GEMM_ROWS, BlockLinear, blocks_linear
from engine.quant_blocks import Q4_1Blocks

# Up to this many sequences a decode step runs natively; from FLOAT_GEMM_ROWS rows on the
# per-op path's float GEMM on dequantized weights is faster than the integer products.
MAX_DECODE_ROWS = FLOAT_GEMM_ROWS - 1
# The KV cache dtypes the native step reads and writes (float16: `kv_cache_dtype="float16"`).
KV_DTYPES = (torch.float32, torch.float16)
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Weight(ctypes.Structure):
    _fields_ = [("codes", _P), ("d", _P), ("m", _P), ("N", _I64), ("K", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _P), ("ffn_norm", _P),
        ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
        ("k_cache", _P), ("v_cache", _P),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
        ("head_dim", _I64), ("intermediate", _I64), ("num_pages", _I64), ("page_size", _I64),
        ("max_position", _I64), ("interleaved", _I64), ("kv_half", _I64), ("rms_eps", _F),
        ("scale", _F),
        ("cos_sin", _P), ("final_norm", _P), ("layers", ctypes.POINTER(_Layer)),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("T", _I64), ("positions", _P), ("slots", _P), ("block_table", _P),
        ("table_width", _I64), ("seq_lens", _P),
    ]  # fmt: skip


def native_step_enabled() -> bool:
    """`PREFIXGATE_NATIVE_STEP`: "on" (default) or "off"."""
    value = os.environ.get("PREFIXGATE_NATIVE_STEP", "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"PREFIXGATE_NATIVE_STEP must be 'on' or 'off', got {value!r}")
    return value == "on"


def _weight(module: object) -> _Weight:
    assert isinstance(module, BlockLinear)
    b = module.blocks
    mins = b.mins.data_ptr() if isinstance(b, Q4_1Blocks) else None
    n, k = b.shape
    return _Weight(b.codes.data_ptr(), b.scales.data_ptr(), mins, n, k)


def _float_vector(t: Tensor) -> int:
    if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
        raise ValueError("native decode needs contiguous float32 CPU norm weights")
    return t.data_ptr()


class NativeDecoder:
    """A model and its KV caches bound to the native decode step (pointers taken once: the
    caller keeps the model and the caches alive and does not reallocate them)."""

    def __init__(
        self,
        model: LlamaModel,
        gemm: BlockGemm,
        k_caches: Sequence[Tensor],
        v_caches: Sequence[Tensor],
    ) -> None:
        if not supports_model(model):
            raise ValueError("native decode needs a float32 CPU model on native block weights")
        c, k0 = model.config, k_caches[0]
        for cache in (*k_caches, *v_caches):
            if cache.dtype not in KV_DTYPES or not cache.is_contiguous() or not cache.is_cpu:
                raise ValueError("native decode needs contiguous float32 or float16 CPU KV caches")
            if cache.dtype != k0.dtype or cache.shape != k0.shape or (
                    tuple(cache.shape[2:]) != (c.num_kv_heads, c.head_dim)):
                raise ValueError(f"KV caches of mismatched shapes or dtypes: {tuple(cache.shape)} "
                                 f"{cache.dtype}")
        if len(k_caches) != c.num_layers or len(v_caches) != c.num_layers:
            raise ValueError(f"expected {c.num_layers} K and V caches")
        layers = (_Layer * c.num_layers)()
        for i, (layer, kc, vc) in enumerate(zip(model.blocks(), k_caches, v_caches, strict=True)):
            weights = {name: _weight(getattr(layer, name)) for name in PROJECTIONS}
            layers[i] = _Layer(
                _float_vector(layer.attn_norm), _float_vector(layer.ffn_norm),
                weights["qkv"], weights["o"], weights["gate_up"], weights["down"],
                kc.data_ptr(), vc.data_ptr(),
            )  # fmt: skip
        self._model_struct = _Model(
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, k0.shape[0], k0.shape[1], model.cos_sin.shape[0],
            int(c.rope_layout == "interleaved"), int(k0.dtype == torch.float16), c.rms_eps,
            c.head_dim**-0.5,
            _float_vector(model.cos_sin), _float_vector(model.norm), layers,
        )  # fmt: skip
        self._model_address = ctypes.addressof(self._model_struct)
        self._layers = layers  # the struct points into it
        self._keep = (model, tuple(k_caches), tuple(v_caches))
        self._embed = model.embed
        # the LM head of these steps' rows, on the step's own products (BF16 tiles where the
        # CPU has them); the model's own head stays on float products for every other step
        head = model.lm_head
        self._head = blocks_linear(head.blocks, gemm) if isinstance(head, BlockLinear) else head
        self._run = gemm.decode_step_function()
        self.argmax = gemm.argmax  # greedy sampling of the logits these steps lead to
        self._level = gemm.level  # the C code's level (0 portable, 1 AVX2, 2 + AVX-512, 3 + BF16)
        # the step's scratch, kept across steps and grown on demand
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._workspace_bytes = _I64(0)

    @staticmethod
    def accepts(meta: AttentionMetadata, rows: int) -> bool:
        """Whether a step of `rows` new tokens with `meta` is one this decoder runs."""
        return meta.is_decode and 0 < rows <= MAX_DECODE_ROWS

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """The decode step's final normed hidden states [T, hidden]; writes the K/V of the new
        tokens into the bound caches."""
        if profiler._is_profiler_enabled:  # name the C call in torch.profiler's tables
            with torch.profiler.record_function("native::decode_step"):
                return self._step(input_ids, positions, meta)
        return self._step(input_ids, positions, meta)

    def logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] final hidden states of these steps -> [N, vocab] float32 logits."""
        logits: Tensor = self._head(hidden)
        return logits.float()

    def _step(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        rows = input_ids.shape[0]
        table, lens, slots = meta.block_table, meta.seq_lens, meta.slot_mapping
        _check_index("positions", positions, torch.int64, rows)
        _check_index("slot_mapping", slots, torch.int64, rows)
        _check_index("seq_lens", lens, torch.int32, rows)
        if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != rows:
            raise ValueError(f"block_table must be int32 [{rows}, pages]")
        table = table.contiguous()
        hidden = F.embedding(input_ids, self._embed)  # [T, hidden], written in place
        step = _Step(
            rows, positions.data_ptr(), slots.data_ptr(), table.data_ptr(), table.shape[1],
            lens.data_ptr(),
        )  # fmt: skip
        threads = torch.get_num_threads()
        status = self._call(step, hidden, threads)
        if status == NEED_WORKSPACE:  # the size it needs is in _workspace_bytes now
            self._workspace = torch.empty(self._workspace_bytes.value, dtype=torch.uint8)
            status = self._call(step, hidden, threads)
        check_status(status, "decode step")
        return hidden

    def _call(self, step: _Step, hidden: Tensor, threads: int) -> int:
        self._workspace_bytes.value = self._workspace.numel()
        return int(
            self._run(
                self._model_address, ctypes.addressof(step), hidden.data_ptr(),
                self._workspace.data_ptr(), ctypes.byref(self._workspace_bytes), threads,
                self._level,
            )  # fmt: skip
        )


def _check_index(name: str, t: Tensor, dtype: torch.dtype, rows: int) -> None:
    if t.dtype != dtype or t.dim() != 1 or t.shape[0] != rows or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} vector of {rows} entries")


def supports_model(model: LlamaModel) -> bool:
    """A float32 CPU model whose projections are all native blocks (int8/int4)."""
    if model.dtype != torch.float32 or model.embed.device.type != "cpu":
        return False
    return all(
        isinstance(getattr(layer, name), BlockLinear)
        for layer in model.blocks()
        for name in PROJECTIONS
    )


def native_decoder(
    model: LlamaModel, k_caches: Sequence[Tensor], v_caches: Sequence[Tensor]
) -> NativeDecoder | None:
    """The model's native decoder, or None (off, no native library, or not a model it runs)."""
    gemm = native_gemm()
    if gemm is None or not native_step_enabled() or not supports_model(model):
        return None
    if k_caches[0].dtype not in KV_DTYPES or not k_caches[0].is_cpu:
        return None
    return NativeDecoder(model, gemm, k_caches, v_caches)
