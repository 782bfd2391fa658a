"""Fast torch paged attention: the CPU runtime path (and the GPU baseline in benchmarks).

Pages are gathered through the block table into dense K/V, then attention runs in
``scaled_dot_product_attention``. On CPU the gather writes into a per-thread workspace that
is reused across calls: a fresh 100 MB tensor per call costs more in page faults than the
copy itself. Decode folds GQA into the query axis (the G query heads that share one KV head
are G query rows of one problem), so K/V are never repeated.

Decode derives a read plan (lengths, page ids, mask) from the block table once per
``checks.step_scope`` and reuses it in every layer. A sequence whose pages are consecutive is
read as a view of the cache, without a gather. On CPU in float32 a sequence read on its own
is two small ``bmm``s: cheaper at one query token than ``scaled_dot_product_attention``.

On CPU in float32 decode always goes sequence by sequence: a padded gather of the whole batch
writes and re-reads every K/V byte through memory (the gathered batch outgrows the cache), and
SDPA with a length mask is slow at a few query rows. Measured per layer (1 thread, SmolLM2 shapes):
B=4 at ~1000 tokens 5.0 ms padded vs 2.6 ms per sequence; B=64 at ~300 tokens 67 ms vs 52 ms;
a 4-sequence engine decode step went from ~280 ms to ~150 ms.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checks import memoized

_local = threading.local()

# Off CPU float32, decode gathers the batch padded to its longest sequence unless that wastes
# more than this factor over the real page count; then it goes sequence by sequence.
PADDING_WASTE_LIMIT = 1.5


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused by this thread (CPU only)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    # A buffer made under inference mode cannot be written outside it (and the other way
    # round costs autograd bookkeeping), so each mode keeps its own.
    key = (dtype, torch.is_inference_mode_enabled())
    buffers: dict[tuple[torch.dtype, bool], torch.Tensor] = getattr(_local, "buffers", None) or {}
    _local.buffers = buffers
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[key] = buf
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


class _SeqPages(NamedTuple):
    """Where one sequence's K/V lives: its pages, or a run of consecutive pages."""

    index: int  # type: ignore[assignment]  # b, the row of q and of the output (shadows tuple.index)
    length: int  # tokens in cache
    pages: torch.Tensor  # [n] int64 page ids
    first_page: int  # >= 0: the pages are first_page.. consecutively (read a view, no gather)


class _DecodePlan(NamedTuple):
    """How one decode step reads the cache; the same for every layer of the step."""

    seqs: list[_SeqPages]  # per-sequence reads (empty when the batch is padded)
    pages: torch.Tensor | None  # [B, n_pages] int64, padded batch only
    mask: torch.Tensor | None  # [B, 1, 1, L] bool, padded batch with unequal lengths
    empty_rows: torch.Tensor | None  # [B] bool: sequences with no tokens (padded batch)


def _seq_pages(
    block_table: torch.Tensor, b: int, length: int, page_size: int, num_pages: int
) -> _SeqPages:
    count = -(-length // page_size)
    row = block_table[b, :count]
    ids = row.tolist()
    first = ids[0]
    consecutive = ids == list(range(first, first + count)) and first >= 0
    in_range = consecutive and first + count <= num_pages
    return _SeqPages(b, length, row.long(), first if in_range else -1)


def _decode_plan(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_pages: int,
    allow_padding: bool = True,
) -> _DecodePlan:
    """The step's read plan; ``allow_padding=False`` always reads sequence by sequence."""
    lengths = seq_lens.tolist()
    page_counts = [-(-n // page_size) for n in lengths]
    n_pages = max(page_counts)
    padded = (
        allow_padding
        and len(lengths) > 1
        and len(lengths) * n_pages <= PADDING_WASTE_LIMIT * sum(page_counts)
    )
    if n_pages == 0 or not padded:
        seqs = [
            _seq_pages(block_table, b, n, page_size, num_pages)
            for b, n in enumerate(lengths)
            if n > 0
        ]
        return _DecodePlan(seqs, None, None, None)
    pages = block_table[:, :n_pages].clamp(0, num_pages - 1).long()  # padding may hold junk
    mask = None
    if min(lengths) != n_pages * page_size:  # some sequence ends before the padded length
        positions = torch.arange(n_pages * page_size, device=seq_lens.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    empty = seq_lens == 0 if 0 in lengths else None
    return _DecodePlan([], pages, mask, empty)


def _decode_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _DecodePlan,
    scale: float,
) -> torch.Tensor:
    """All sequences at once, padded to the longest and masked by length."""
    assert plan.pages is not None
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k, v = gather_kv(k_cache, v_cache, plan.pages)  # [B, L, Hkv, D]
    qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.mask, scale=scale
    )  # [B, Hkv, G, D]
    out = out.reshape(batch, num_q_heads, head_dim)
    if plan.empty_rows is not None:  # a fully masked row is NaN; an empty sequence reads nothing
        out[plan.empty_rows] = 0.0
    return out


def _attend_one(
    q_row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: _SeqPages, scale: float
) -> torch.Tensor:
    """q_row [Hq, D] over one sequence's cached tokens -> [Hkv, G, D]."""
    num_q_heads, head_dim = q_row.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    n = seq.pages.shape[0]
    if seq.first_page >= 0:  # consecutive pages: a view of the cache, no copy
        span = slice(seq.first_page, seq.first_page + n)
        k = k_cache[span].view(n * page_size, num_kv_heads, head_dim)
        v = v_cache[span].view(n * page_size, num_kv_heads, head_dim)
    else:
        k, v = gather_kv(k_cache, v_cache, seq.pages)  # [n * page, Hkv, D]
    qg = q_row.view(num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [Hkv, G, D]
    k, v = k[: seq.length].transpose(0, 1), v[: seq.length].transpose(0, 1)  # [Hkv, L, D]
    if q_row.dtype == torch.float32 and not q_row.is_cuda:
        # A few query rows per KV head: two small bmm's beat SDPA's per-call setup on CPU.
        scores = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)  # [Hkv, G, L]
        return torch.bmm(torch.softmax(scores, dim=-1), v)  # [Hkv, G, D]
    return F.scaled_dot_product_attention(qg, k, v, scale=scale)


def _decode_each(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: _DecodePlan,
    scale: float,
) -> torch.Tensor:
    """One sequence at a time, each reading only its own pages."""
    batch, num_q_heads, head_dim = q.shape
    if batch == 1 and len(plan.seqs) == 1:  # single stream: no output buffer to fill
        return _attend_one(q[0], k_cache, v_cache, plan.seqs[0], scale).reshape(q.shape)
    out = torch.zeros_like(q)
    for seq in plan.seqs:
        o = _attend_one(q[seq.index], k_cache, v_cache, seq, scale)
        out[seq.index] = o.reshape(num_q_heads, head_dim)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] over paged K/V -> [B, Hq, D] in q's dtype (inputs already checked).

    The read plan (lengths, page ids, mask) is derived once per ``step_scope`` for all layers.
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    # CPU float32 reads each sequence on its own (see the module docstring).
    allow_padding = q.device.type != "cpu" or q.dtype != torch.float32
    plan = memoized(
        ("decode_plan", page_size, num_pages, allow_padding),
        (block_table, seq_lens),
        lambda: _decode_plan(block_table, seq_lens, page_size, num_pages, allow_padding),
    )
    if plan.pages is not None:
        return _decode_padded(q, k_cache, v_cache, plan, scale)
    return _decode_each(q, k_cache, v_cache, plan, scale)


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
