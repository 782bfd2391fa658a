"""Fast torch paged attention: the CPU runtime path (and the GPU baseline in benchmarks).

Pages are gathered through the block table into dense K/V, then attention runs in
``scaled_dot_product_attention``. On CPU the gather writes into a per-thread workspace that
is reused across calls: a fresh 100 MB tensor per call costs more in page faults than the
copy itself. Decode folds GQA into the query axis (the G query heads that share one KV head
are G query rows of one problem), so K/V are never repeated.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

_local = threading.local()

# Decode gathers the batch padded to its longest sequence unless that wastes more than this
# factor over the real page count; then it goes sequence by sequence.
PADDING_WASTE_LIMIT = 1.5


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused by this thread (CPU only)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buffers: dict[torch.dtype, torch.Tensor] = getattr(_local, "buffers", None) or {}
    _local.buffers = buffers
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[dtype] = buf
    return buf[:numel]


def release_workspace() -> None:
    """Free this thread's gather workspace (it grows to the largest batch seen)."""
    _local.buffers = {}


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather pages [n] (or [B, n]) of both caches -> K, V [..., n * page_size, Hkv, D].

    The results are views of the workspace: use them before the next gather on this thread.
    """
    flat = pages.reshape(-1).long()
    page_shape = k_cache.shape[1:]  # [page_size, Hkv, D]
    page_numel = k_cache[0].numel()
    buf = _workspace(2 * flat.numel() * page_numel, k_cache.dtype, k_cache.device)
    k_buf, v_buf = buf.view(2, flat.numel(), *page_shape).unbind(0)
    torch.index_select(k_cache, 0, flat, out=k_buf)
    torch.index_select(v_cache, 0, flat, out=v_buf)
    out_shape = (*pages.shape[:-1], pages.shape[-1] * page_shape[0], *page_shape[1:])
    return k_buf.view(out_shape), v_buf.view(out_shape)


def _decode_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    n_pages: int,
    full_length: int,
) -> torch.Tensor:
    """All sequences at once, padded to n_pages and masked by length.

    ``full_length`` is the shortest sequence length: when every sequence fills all n_pages,
    no mask is needed.
    """
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    pages = block_table[:, :n_pages].clamp(0, num_pages - 1)  # unused entries may hold junk
    k, v = gather_kv(k_cache, v_cache, pages)  # [B, L, Hkv, D]
    mask = None
    if full_length != n_pages * page_size:  # some sequence ends before the padded length
        positions = torch.arange(n_pages * page_size, device=q.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim)


def _decode_each(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: list[int],
    scale: float,
) -> torch.Tensor:
    """One sequence at a time, each gathering only its own pages."""
    _, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(q)
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_table[b, : -(-length // page_size)])
        qg = q[b].view(num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [Hkv, G, D]
        o = F.scaled_dot_product_attention(
            qg, k[:length].transpose(0, 1), v[:length].transpose(0, 1), scale=scale
        )
        out[b] = o.reshape(num_q_heads, head_dim)
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
    if q.shape[0] == 0:
        return torch.empty_like(q)
    page_size = k_cache.shape[1]
    lengths = seq_lens.tolist()
    page_counts = [-(-n // page_size) for n in lengths]
    n_pages = max(page_counts)
    if n_pages == 0:
        return torch.zeros_like(q)
    if len(lengths) * n_pages > PADDING_WASTE_LIMIT * sum(page_counts):
        return _decode_each(q, k_cache, v_cache, block_table, lengths, scale)
    out = _decode_padded(
        q, k_cache, v_cache, block_table, seq_lens, scale, n_pages, min(lengths)
    )
    if 0 in lengths:  # a fully masked row is NaN; a sequence without tokens reads nothing
        out[seq_lens == 0] = 0.0
    return out


def _causal_mask(n_new: int, total: int, device: torch.device) -> torch.Tensor:
    """[n_new, total] bool: new token i (position total - n_new + i) sees keys <= its position."""
    query_pos = torch.arange(total - n_new, total, device=device)
    return torch.arange(total, device=device)[None, :] <= query_pos[:, None]


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
        k, v = gather_kv(k_cache, v_cache, block_table[b, : -(-total // page_size)])
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, n, D]
            k[:total].transpose(0, 1),  # [Hkv, L, D]
            v[:total].transpose(0, 1),
            attn_mask=_causal_mask(end - start, total, q.device),
            scale=scale,
            enable_gqa=True,
        )  # [Hq, n, D]
        out[start:end] = o.transpose(0, 1)
    return out
