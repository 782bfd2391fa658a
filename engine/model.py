"""Llama-family decoder whose attention reads and writes a paged KV cache (`paged_kernels`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import paged_kernels
from engine.attention_metadata import AttentionMetadata
from engine.linear import QUANTIZATIONS, DenseLinear, Linear, Quantization, quantize_linear
from engine.model_config import ModelConfig

# Canonical weight names (what engine.gguf and engine.hf_folder produce), per layer i:
#   layers.{i}.attn_norm, layers.{i}.q, layers.{i}.k, layers.{i}.v, layers.{i}.o,
#   layers.{i}.ffn_norm, layers.{i}.gate, layers.{i}.up, layers.{i}.down
# plus embed [vocab, hidden], norm [hidden] and, when embeddings are not tied, lm_head.
# Linear weights are [out_features, in_features] like torch.nn.Linear.

PROJECTIONS = ("qkv", "o", "gate_up", "down")

# The LM head is the largest single matrix and the most sensitive to rounding: under int4 it
# is stored as int8 (Q8_0 blocks), like llama.cpp keeps a higher-precision output tensor.
HEAD_QUANTIZATION: dict[str, Quantization] = {"fp16": "fp16", "int8": "int8", "int4": "int8"}


def _vector(size: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm block: GQA attention with rotary over the paged cache, then a SwiGLU MLP.

    Q/K/V and gate/up are fused into one projection each so every projection is one matmul.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.config = c
        self.q_size = c.q_size
        self.attn_norm = _vector(c.hidden_size, dtype)
        self.qkv: Linear = DenseLinear(c.q_size + 2 * c.kv_size, c.hidden_size, dtype)
        self.o: Linear = DenseLinear(c.hidden_size, c.q_size, dtype)
        self.ffn_norm = _vector(c.hidden_size, dtype)
        self.gate_up: Linear = DenseLinear(2 * c.intermediate_size, c.hidden_size, dtype)
        self.down: Linear = DenseLinear(c.hidden_size, c.intermediate_size, dtype)

    def forward(
        self,
        hidden: Tensor,  # [T, hidden]: this block's input (output of the previous block)
        residual: Tensor | None,  # [T, hidden] running residual stream, None for the first block
        ops: paged_kernels.StepOps,  # the step's checked plans and layer ops
        k_cache: Tensor,  # [P, page, Hkv, D]
        v_cache: Tensor,  # [P, page, Hkv, D]
    ) -> tuple[Tensor, Tensor]:
        x, residual = ops.add_rms_norm(hidden, residual, self.attn_norm)
        q, k, v = ops.split_rotate(self.qkv(x))  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        ops.store_kv(k, v, k_cache, v_cache)
        attn = ops.attend(q, k_cache, v_cache).reshape(x.shape[0], self.q_size)  # [T, Hq * D]
        x, residual = ops.add_rms_norm(self.o(attn), residual, self.ffn_norm)
        return self.down(ops.silu_and_mul(self.gate_up(x))), residual


class LlamaModel(nn.Module):
    """Embedding, `num_layers` decoder blocks, final RMSNorm and (possibly tied) LM head.

    `forward` runs one engine step over T new tokens of B sequences (ragged, described by `meta`),
    writing their K/V into the per-layer paged caches and returning the final hidden states.
    Weights start uninitialised; fill them with `load_weights` (or copy into every parameter),
    then optionally `quantize`.
    """

    cos_sin: Tensor  # [max_pos, D] float32 rotary table (a non-persistent buffer)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"LlamaModel dtype must be a floating dtype, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.quantization: Quantization = "none"
        self.embed = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self._blocks = tuple(self.blocks())  # typed, and iterated without ModuleList's overhead
        c = config
        self.geometry = paged_kernels.LayerGeometry(
            c.num_heads, c.num_kv_heads, c.head_dim, c.rms_eps, c.head_dim**-0.5
        )
        self.norm = _vector(config.hidden_size, dtype)
        self.lm_head: Linear = DenseLinear(config.vocab_size, config.hidden_size, dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed
        cos_sin = paged_kernels.rotary_cache(
            config.max_position, config.head_dim, config.rope_theta, torch.float32
        )
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        meta: AttentionMetadata,
        k_caches: list[Tensor],  # num_layers x [P, page, Hkv, D]
        v_caches: list[Tensor],  # num_layers x [P, page, Hkv, D]
        kernel_backend: str | None = None,
    ) -> Tensor:  # [T, hidden]
        """One step. `kernel_backend`: "torch", "triton", or None/"auto" (by device); a
        planned `meta` (see `AttentionMetadata.planned`) must have been planned for it."""
        if len(k_caches) != self.config.num_layers or len(v_caches) != self.config.num_layers:
            raise ValueError(
                f"expected {self.config.num_layers} K and V caches, "
                f"got {len(k_caches)} and {len(v_caches)}"
            )
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        ops = self.plan_step(positions, meta, k_caches, v_caches, kernel_backend)
        residual: Tensor | None = None
        for layer, k_cache, v_cache in zip(self._blocks, k_caches, v_caches, strict=True):
            hidden, residual = layer(hidden, residual, ops, k_cache, v_cache)
        return ops.add_rms_norm(hidden, residual, self.norm).normed

    def plan_step(
        self,
        positions: Tensor,  # [T] int64
        meta: AttentionMetadata,
        k_caches: list[Tensor],
        v_caches: list[Tensor],
        backend: str | None = None,
    ) -> paged_kernels.StepOps:
        """Every layer sees the same metadata: check it, the caches and the layer geometry, and
        derive the index plans (page reads, slots, rotary angles) once per step, explicitly;
        the layers then run their ops without checks."""
        chosen = paged_kernels.resolve_backend(None if backend == "auto" else backend, k_caches[0])
        if meta.plan is None:
            meta = meta.planned(k_caches[0], chosen)
        assert meta.plan is not None
        layout = self.config.rope_layout
        rotary = paged_kernels.plan_rotary(positions, self.cos_sin, layout, backend=chosen)
        return paged_kernels.plan_step(meta.plan, rotary, k_caches, v_caches, self.geometry,
                                       self.dtype)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        logits: Tensor = self.lm_head(hidden)
        return logits.float()

    def blocks(self) -> list[DecoderLayer]:
        """The decoder blocks, typed (`self.layers` is an `nn.ModuleList`)."""
        return [_block(layer) for layer in self.layers]

    @torch.no_grad()
    def quantize(self, quantization: Quantization) -> None:
        """Swap every projection and the LM head to `quantization` (see `engine.linear`):
        "fp16" fp16 weights; "int8" Q8_0 blocks; "int4" Q4_1 blocks (LM head Q8_0).

        Only float32 CPU models can be quantised; the embedding table stays float32 (a decode
        step reads one row of it). Irreversible: load again for the float32 reference.
        """
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; choose from {QUANTIZATIONS}")
        if quantization == "none":
            return
        if self.quantization != "none" or self.dtype != torch.float32:
            raise ValueError("quantize needs an unquantised float32 model")
        for layer in self.blocks():
            for name in PROJECTIONS:
                dense = _dense(getattr(layer, name))
                setattr(layer, name, quantize_linear(dense.weight, quantization))
        self.lm_head = quantize_linear(
            _dense(self.lm_head).weight, HEAD_QUANTIZATION[quantization]
        )
        self.quantization = quantization

    def streamed_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: projections, norms and LM head (not the table)."""
        total = self.lm_head.weight_bytes() + self.norm.numel() * self.norm.element_size()
        for layer in self.blocks():
            total += sum(_linear(getattr(layer, name)).weight_bytes() for name in PROJECTIONS)
            total += 2 * layer.attn_norm.numel() * layer.attn_norm.element_size()
        return total

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Take canonical-named weights (see the module comment) into the (fused) parameters.

        Tensors already in the model dtype are used without copying, so the caller must not
        modify them afterwards.
        """
        if self.quantization != "none":
            raise ValueError("load_weights must run before quantize")
        self._copy(self.embed, weights, "embed")
        self._copy(self.norm, weights, "norm")
        if not self.config.tie_embeddings:
            self._copy(_dense(self.lm_head).weight, weights, "lm_head")
        for i, layer in enumerate(self.blocks()):
            p = f"layers.{i}."
            self._copy(layer.attn_norm, weights, p + "attn_norm")
            self._copy(layer.ffn_norm, weights, p + "ffn_norm")
            self._copy(_dense(layer.o).weight, weights, p + "o")
            self._copy(_dense(layer.down).weight, weights, p + "down")
            self._copy_fused(_dense(layer.qkv).weight, weights, [p + "q", p + "k", p + "v"])
            self._copy_fused(_dense(layer.gate_up).weight, weights, [p + "gate", p + "up"])

    @staticmethod
    def _copy(param: Tensor, weights: Mapping[str, Tensor], name: str) -> None:
        if name not in weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        LlamaModel._assign(param, weights[name], name)

    @staticmethod
    def _assign(param: Tensor, src: Tensor, name: str) -> None:
        """Point `param` at `src` (no copy when dtypes match; the caller hands over `src`)."""
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(param.shape)}"
            )
        param.data = src.detach().to(param.dtype).contiguous()

    @classmethod
    def _copy_fused(cls, param: Tensor, weights: Mapping[str, Tensor], names: list[str]) -> None:
        missing = [n for n in names if n not in weights]
        if missing:
            raise KeyError(f"weights {missing} missing from the checkpoint")
        fused = torch.cat([weights[n].to(param.dtype) for n in names], dim=0)
        cls._assign(param, fused, "+".join(names))


def _block(module: nn.Module) -> DecoderLayer:
    assert isinstance(module, DecoderLayer), f"expected a DecoderLayer, got {type(module)}"
    return module


def _linear(module: object) -> Linear:
    assert isinstance(module, Linear), f"expected a Linear projection, got {type(module)}"
    return module


def _dense(module: object) -> DenseLinear:
    """The unquantised projection (its `weight` parameter is what loading and quantising use)."""
    assert isinstance(module, DenseLinear), f"expected a DenseLinear, got {type(module)}"
    return module
