"""Fast torch paged attention: the CPU runtime path (and the GPU baseline in benchmarks).

Pages are gathered through the block table into dense K/V, then attention runs in
``scaled_dot_product_attention``. GQA is folded into the query-length axis: the G query heads
that share one KV head become G rows of one attention problem, so K/V are never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [P, page_size, Hkv, D], pages [..., n] -> [..., n * page_size, Hkv, D]."""
    gathered = cache[pages.long()]  # [..., n, page_size, Hkv, D]
    return gathered.flatten(-4, -3)


def _zero_empty(out: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Sequences without tokens attend to nothing: their output is zero, not NaN."""
    empty = seq_lens == 0
    if bool(empty.any()):
        out = out.masked_fill(empty.view(-1, *([1] * (out.dim() - 1))), 0.0)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] over paged K/V -> [B, Hq, D] in q's dtype (inputs already checked)."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if batch == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    n_pages = max(1, -(-max_len // page_size))
    pages = block_table[:, :n_pages].clamp(0, num_pages - 1)  # unused entries may hold junk
    k = gather_pages(k_cache, pages).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_pages(v_cache, pages).transpose(1, 2)
    positions = torch.arange(n_pages * page_size, device=q.device)
    mask = positions[None, :] < seq_lens[:, None]  # [B, L]
    qg = q.view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return _zero_empty(out.reshape(batch, num_q_heads, head_dim), seq_lens)


def _prefill_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D] (the last n of L positions), k, v [L, Hkv, D] -> [n, Hq, D], causal."""
    n_new, num_q_heads, head_dim = q.shape
    total, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    qg = q.view(n_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    qg = qg.reshape(num_kv_heads, group * n_new, head_dim)
    query_pos = torch.arange(total - n_new, total, device=q.device)
    mask = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]  # [n, L]
    mask = mask.repeat(group, 1)  # [G * n, L], row g * n + i is query token i
    out = F.scaled_dot_product_attention(
        qg, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )  # [Hkv, G * n, D]
    return out.view(num_kv_heads, group, n_new, head_dim).permute(2, 0, 1, 3).reshape(q.shape)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] (ragged by cu_seqlens_q) over paged K/V -> [T, Hq, D], causal per sequence."""
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, total in enumerate(seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        pages = block_table[b, : -(-total // page_size)]
        k = gather_pages(k_cache, pages)[:total]  # [L, Hkv, D]
        v = gather_pages(v_cache, pages)[:total]
        out[start:end] = _prefill_one(q[start:end], k, v, scale)
    return out
