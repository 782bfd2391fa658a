"""Plain, obviously-correct float32 references: the ground truth for every other path.

Simple on purpose: each token is looked up by its own page and offset, and attention is
dense with an explicit mask. Tests compare the fast torch path and the Triton kernels
against these functions.
"""

from __future__ import annotations

import torch


def gather_tokens(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """Token t of a sequence lives at page block_row[t // page_size], offset t % page_size."""
    page_size = cache.shape[1]
    t = torch.arange(length)
    return cache[block_row[t // page_size].long(), t % page_size]  # [length, Hkv, D]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense attention in float32 with GQA by repetition.

    q [N, Hq, D], k, v [L, Hkv, D], mask [N, L] bool (True = may attend) -> [N, Hq, D] float32.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale  # [Hq, N, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


def causal_mask(n_new: int, total: int) -> torch.Tensor:
    """New token i sits at position total - n_new + i and sees keys 0..that position."""
    query_pos = torch.arange(total - n_new, total).unsqueeze(1)  # [n_new, 1]
    key_pos = torch.arange(total).unsqueeze(0)  # [1, total]
    return key_pos <= query_pos


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] float32; each query sees all seq_lens[b] cached tokens."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        k = gather_tokens(k_cache, block_table[b], length)
        v = gather_tokens(v_cache, block_table[b], length)
        mask = torch.ones(1, length, dtype=torch.bool)
        out[b] = dense_attention(q[b : b + 1], k, v, mask, scale)[0]
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] float32; new tokens attend causally to prefix and themselves."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(seq_lens.shape[0]):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        length = int(seq_lens[b])
        k = gather_tokens(k_cache, block_table[b], length)
        v = gather_tokens(v_cache, block_table[b], length)
        mask = causal_mask(end - start, length)
        out[start:end] = dense_attention(q[start:end], k, v, mask, scale)
    return out


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V to slot slot_mapping[t] (page * page_size + offset); skip slot < 0."""
    page_size = k_cache.shape[1]
    for t in range(k.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        k_cache[slot // page_size, slot % page_size] = k[t]
        v_cache[slot // page_size, slot % page_size] = v[t]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] * weight / sqrt(mean(x^2) + eps), in float32."""
    x = x.float()
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight.float()


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str
) -> torch.Tensor:
    """Rotate each (a, b) pair of x [T, H, D] by the angle whose cos/sin are [T, D/2]."""
    x = x.float()
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]  # [T, 1, D/2]
    if layout == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
    else:
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos - b * sin
        out[..., half:] = b * cos + a * sin
    return out


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE computed from theta directly (no cache): angle_i = pos * theta^(-2i/D)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = torch.cos(angles), torch.sin(angles)
    return rotate_pairs(q, cos, sin, layout), rotate_pairs(k, cos, sin, layout)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2F] -> silu(x[..., :F]) * x[..., F:], in float32."""
    x = x.float()
    a, b = x.chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b
