"""A plain dense forward of `LlamaModel`'s weights: no paging, no kernels, whole sequence at once.

This is the test reference for the engine's paged path: the same math written the textbook way
(float32 RMSNorm, rotary from sin/cos tables, GQA by repeating K/V heads, causal SDPA).
Quantised projections are used through their dequantised float32 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model import DecoderLayer, LlamaModel
from engine.model_config import ModelConfig


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _rope(x: Tensor, positions: Tensor, config: ModelConfig) -> Tensor:
    """x [L, H, D] rotated by position; pairs are (2i, 2i+1) or (i, i + D/2) per rope_layout."""
    d = config.head_dim
    inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None, :]  # [L, D/2]
    cos = angles.cos().float()[:, None, :]
    sin = angles.sin().float()[:, None, :]
    xf = x.float()
    if config.rope_layout == "interleaved":
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.to(x.dtype)


def _layer(layer: DecoderLayer, x: Tensor, positions: Tensor, config: ModelConfig) -> Tensor:
    c = config
    length = x.shape[0]
    h = _rms_norm(x, layer.attn_norm, c.rms_eps)
    qkv = F.linear(h, layer.qkv.dequantized())
    q, k, v = torch.split(qkv, [c.q_size, c.kv_size, c.kv_size], dim=-1)
    q = _rope(q.reshape(length, c.num_heads, c.head_dim), positions, c)
    k = _rope(k.reshape(length, c.num_kv_heads, c.head_dim), positions, c)
    v = v.reshape(length, c.num_kv_heads, c.head_dim)
    group = c.num_heads // c.num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )  # [Hq, L, D]
    x = x + F.linear(attn.transpose(0, 1).reshape(length, c.q_size), layer.o.dequantized())
    h = _rms_norm(x, layer.ffn_norm, c.rms_eps)
    gate, up = F.linear(h, layer.gate_up.dequantized()).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, layer.down.dequantized())


@torch.inference_mode()
def dense_logits(model: LlamaModel, token_ids: list[int] | Tensor) -> Tensor:
    """Logits [L, vocab] float32 for every position of one sequence (causal, from position 0)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("token_ids must be a non-empty 1-D sequence")
    c = model.config
    positions = torch.arange(ids.numel())
    x = F.embedding(ids, model.embed)  # [L, hidden]
    for layer in model.blocks():
        x = _layer(layer, x, positions, c)
    return F.linear(_rms_norm(x, model.norm, c.rms_eps), model.lm_head.dequantized()).float()


def greedy_generate(
    model: LlamaModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Greedy continuation of `prompt_ids` (recomputes the whole sequence every step)."""
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(dense_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
        if token in stop_token_ids:
            break
    return out
