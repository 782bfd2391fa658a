"""Llama-family decoder whose attention reads and writes a paged KV cache through `kernels`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from engine.attention_metadata import AttentionMetadata
from engine.model_config import ModelConfig

# Canonical weight names (what engine.gguf and engine.hf_folder produce), per layer i:
#   layers.{i}.attn_norm, layers.{i}.q, layers.{i}.k, layers.{i}.v, layers.{i}.o,
#   layers.{i}.ffn_norm, layers.{i}.gate, layers.{i}.up, layers.{i}.down
# plus embed [vocab, hidden], norm [hidden] and, when embeddings are not tied, lm_head.
# Linear weights are [out_features, in_features] like torch.nn.Linear.


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm block: GQA attention with rotary over the paged cache, then a SwiGLU MLP.

    Q/K/V and gate/up are fused into one weight each so every projection is one matmul.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.config = c
        self.scale = c.head_dim**-0.5
        self.attn_norm = _empty(c.hidden_size, dtype=dtype)
        self.qkv = _empty(c.q_size + 2 * c.kv_size, c.hidden_size, dtype=dtype)
        self.o = _empty(c.hidden_size, c.q_size, dtype=dtype)
        self.ffn_norm = _empty(c.hidden_size, dtype=dtype)
        self.gate_up = _empty(2 * c.intermediate_size, c.hidden_size, dtype=dtype)
        self.down = _empty(c.hidden_size, c.intermediate_size, dtype=dtype)

    def forward(
        self,
        hidden: Tensor,  # [T, hidden]: this block's input (output of the previous block)
        residual: Tensor | None,  # [T, hidden] running residual stream, None for the first block
        positions: Tensor,  # [T] int64
        meta: AttentionMetadata,
        k_cache: Tensor,  # [P, page, Hkv, D]
        v_cache: Tensor,  # [P, page, Hkv, D]
        cos_sin: Tensor,  # [max_pos, D]
    ) -> tuple[Tensor, Tensor]:
        c = self.config
        eps = c.rms_eps
        if residual is None:
            residual = hidden
            x = kernels.rms_norm(hidden, self.attn_norm, eps)
        else:
            x, residual = kernels.rms_norm(hidden, self.attn_norm, eps, residual)
        attn = self._attention(x, positions, meta, k_cache, v_cache, cos_sin)
        x, residual = kernels.rms_norm(attn, self.ffn_norm, eps, residual)
        gate_up = F.linear(x, self.gate_up)  # [T, 2F]
        return F.linear(kernels.silu_and_mul(gate_up), self.down), residual

    def _attention(
        self,
        x: Tensor,  # [T, hidden]
        positions: Tensor,
        meta: AttentionMetadata,
        k_cache: Tensor,
        v_cache: Tensor,
        cos_sin: Tensor,
    ) -> Tensor:
        c = self.config
        t = x.shape[0]
        qkv = F.linear(x, self.qkv)  # [T, q + 2 kv]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(t, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = k.view(t, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = v.view(t, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        q, k = kernels.rotary(q, k, positions, cos_sin, layout=c.rope_layout)
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            out = kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, self.scale
            )
        else:
            out = kernels.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_table, meta.cu_seqlens_q, meta.seq_lens, self.scale
            )
        return F.linear(out.reshape(t, c.q_size), self.o)  # [T, hidden]


class LlamaModel(nn.Module):
    """Embedding, `num_layers` decoder blocks, final RMSNorm and (possibly tied) LM head.

    `forward` runs one engine step over T new tokens of B sequences (ragged, described by `meta`),
    writing their K/V into the per-layer paged caches and returning the final hidden states.
    Weights start as zeros; fill them with `load_weights`.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"LlamaModel dtype must be a floating dtype, got {dtype}")
        self.config = config
        self.dtype = dtype
        self.embed = _empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = _empty(config.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed
            if config.tie_embeddings
            else _empty(config.vocab_size, config.hidden_size, dtype=dtype)
        )
        cos_sin = kernels.rotary_cache(
            config.max_position, config.head_dim, config.rope_theta, torch.float32
        )
        self.register_buffer("cos_sin", cos_sin.to(dtype), persistent=False)

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        meta: AttentionMetadata,
        k_caches: list[Tensor],  # num_layers x [P, page, Hkv, D]
        v_caches: list[Tensor],  # num_layers x [P, page, Hkv, D]
    ) -> Tensor:  # [T, hidden]
        if len(k_caches) != self.config.num_layers or len(v_caches) != self.config.num_layers:
            raise ValueError(
                f"expected {self.config.num_layers} K and V caches, "
                f"got {len(k_caches)} and {len(v_caches)}"
            )
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        residual: Tensor | None = None
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            hidden, residual = layer(
                hidden, residual, positions, meta, k_cache, v_cache, self.cos_sin
            )
        normed, _ = kernels.rms_norm(hidden, self.norm, self.config.rms_eps, residual)
        return normed

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return F.linear(hidden, self.lm_head).float()

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Copy canonical-named weights (see the module comment) into the fused parameters."""
        c = self.config
        self._copy(self.embed, weights, "embed")
        self._copy(self.norm, weights, "norm")
        if not c.tie_embeddings:
            self._copy(self.lm_head, weights, "lm_head")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            self._copy(layer.attn_norm, weights, p + "attn_norm")
            self._copy(layer.ffn_norm, weights, p + "ffn_norm")
            self._copy(layer.o, weights, p + "o")
            self._copy(layer.down, weights, p + "down")
            self._copy_fused(layer.qkv, weights, [p + "q", p + "k", p + "v"])
            self._copy_fused(layer.gate_up, weights, [p + "gate", p + "up"])

    @staticmethod
    def _copy(param: Tensor, weights: Mapping[str, Tensor], name: str) -> None:
        if name not in weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        src = weights[name]
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(src)

    @classmethod
    def _copy_fused(cls, param: Tensor, weights: Mapping[str, Tensor], names: list[str]) -> None:
        row = 0
        for name in names:
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            rows = weights[name].shape[0]
            cls._copy(param[row : row + rows], weights, name)
            row += rows
        if row != param.shape[0]:
            raise ValueError(f"fused weights {names} have {row} rows, expected {param.shape[0]}")
