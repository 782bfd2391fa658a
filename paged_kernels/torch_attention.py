"""Fast torch paged attention: the CPU runtime path (and the GPU baseline in benchmarks).

A float16 cache of float32 activations (``EngineConfig(kv_cache_dtype="float16")``) is read as
float16 and converted to float32 right after the read (the copy a gather makes anyway, or one
more for a view); every product runs in float32.

Pages are gathered through the block table into dense K/V, then attention runs in
``scaled_dot_product_attention``. On CPU the gather writes into a per-thread workspace that
is reused across calls: a fresh 100 MB tensor per call costs more in page faults than the
copy itself. Decode folds GQA into the query axis (the G query heads that share one KV head
are G query rows of one problem), so K/V are never repeated.

Decode derives a read plan (lengths, page ids, mask) from the block table; the engine builds
it once per step (``paged_kernels.plan_attention``) and every layer reuses it. A sequence whose
pages are consecutive is read as a view of the cache, without a gather. On CPU in float32 a sequence
read on its own is two small ``bmm``s: cheaper at one query token than SDPA.

On CPU in float32 a decode batch of several sequences is gathered padded to its longest
sequence and read by one SDPA call per layer (masked by length) as long as the gathered K/V
stays small (``PADDED_GATHER_BYTES``); past that it goes sequence by sequence, each reading a
view of its pages when they are consecutive. Per-sequence reads cost a handful of small ops
per sequence per layer, and each small op with two threads on a busy machine can wait a whole
scheduler slice for the second thread; one padded call per layer does not scale with the batch.
Measured per layer (SmolLM2 shapes, B=8, median of 15; load 4-6 on 2 cores): at 64 tokens
0.26 ms padded vs 0.60 ms per sequence with views (1 thread), 0.29 vs 7.7 ms (2 threads);
at 300 tokens 1.2 vs 1.8 ms (1 thread, gathered); at 1000 tokens 7.7 vs 6.9 ms (1 thread) and
25 vs 65 ms (2 threads). The first round measured B=4 at ~1000 tokens 5.0 ms padded vs 2.6 ms
per sequence (1 thread): long contexts stay per sequence. A single sequence reads a view.

Prefill of a sequence with only a few new tokens (a speculative draft being verified: the
last real token plus up to ~16 draft tokens over a long cached context) on CPU in float32
reads its K/V once, as a view when its pages are consecutive, with the same two ``bmm``s and
a causal mask over the new rows: at 2170 cached tokens, 6 rows cost ~1.5x one decode row, where
the gather + SDPA path cost ~6x.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

_local = threading.local()

# Off CPU float32, decode gathers the batch padded to its longest sequence unless that wastes
# more than this factor over the real page count; then it goes sequence by sequence.
PADDING_WASTE_LIMIT = 1.5
# CPU float32 prefill: a sequence with at most this many new tokens reads K/V once with bmm.
FEW_NEW_TOKENS = 16
# CPU float32 decode: a padded gather of the batch may write at most this many K+V bytes per
# layer (8 MB: 8 sequences of ~680 tokens in SmolLM2-135M); past it, sequence by sequence.
PADDED_GATHER_BYTES = 8 << 20
# CPU decode that reads at most this many K+V bytes per layer runs on one thread (see
# ``serial_decode``): 16 MB is ~11k tokens of SmolLM2-135M in float32.
SERIAL_DECODE_BYTES = 16 << 20


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


class SeqPages(NamedTuple):
    """Where one sequence's K/V lives: its pages, or a run of consecutive pages."""

    row: int  # b, the row of q and of the output
    length: int  # tokens in cache
    pages: torch.Tensor  # [n] int64 page ids
    first_page: int  # >= 0: the pages are first_page.. consecutively (read a view, no gather)


class DecodeReadPlan(NamedTuple):
    """How one decode step reads the cache; the same for every layer of the step."""

    seqs: list[SeqPages]  # per-sequence reads (empty when the batch is padded)
    pages: torch.Tensor | None  # [B, n_pages] int64, padded batch only
    mask: torch.Tensor | None  # [B, 1, 1, L] bool, padded batch with unequal lengths
    empty_rows: torch.Tensor | None  # [B] bool: sequences with no tokens (padded batch)
    padded_len: int = 0  # L: tokens read per sequence of the padded batch (its longest)


def _seq_pages(
    block_table: torch.Tensor, b: int, length: int, page_size: int, num_pages: int
) -> SeqPages:
    count = -(-length // page_size)
    row = block_table[b, :count]
    ids = row.tolist()
    first = ids[0]
    consecutive = ids == list(range(first, first + count)) and first >= 0
    in_range = consecutive and first + count <= num_pages
    return SeqPages(b, length, row.long(), first if in_range else -1)


def decode_read_plan(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_pages: int,
    allow_padding: bool = True,
    max_padded_pages: int | None = None,
) -> DecodeReadPlan:
    """The step's read plan; ``allow_padding=False`` always reads sequence by sequence.

    ``max_padded_pages``: the most pages a padded gather may copy (None: no limit); see
    ``padded_page_limit``."""
    lengths = seq_lens.tolist()
    page_counts = [-(-n // page_size) for n in lengths]
    n_pages = max(page_counts)
    padded = (
        allow_padding
        and len(lengths) > 1
        and len(lengths) * n_pages <= PADDING_WASTE_LIMIT * sum(page_counts)
        and (max_padded_pages is None or len(lengths) * n_pages <= max_padded_pages)
    )
    if n_pages == 0 or not padded:
        seqs = [
            _seq_pages(block_table, b, n, page_size, num_pages)
            for b, n in enumerate(lengths)
            if n > 0
        ]
        return DecodeReadPlan(seqs, None, None, None)
    pages = block_table[:, :n_pages].clamp(0, num_pages - 1).long()  # padding may hold junk
    longest = max(lengths)
    mask = None
    if min(lengths) != longest:  # some sequence ends before the padded length
        positions = torch.arange(longest, device=seq_lens.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    empty = seq_lens == 0 if 0 in lengths else None
    return DecodeReadPlan([], pages, mask, empty, longest)


def _decode_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodeReadPlan,
    scale: float,
) -> torch.Tensor:
    """All sequences at once, padded to the longest and masked by length."""
    assert plan.pages is not None
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k, v = gather_kv(k_cache, v_cache, plan.pages)  # [B, pages * page_size, Hkv, D]
    k, v = k[:, : plan.padded_len].transpose(1, 2), v[:, : plan.padded_len].transpose(1, 2)
    k, v = _in_dtype(k, q.dtype), _in_dtype(v, q.dtype)
    qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(
        qg, k, v, attn_mask=plan.mask, scale=scale
    )  # [B, Hkv, G, D] over K/V [B, Hkv, L, D]
    out = out.reshape(batch, num_q_heads, head_dim)
    if plan.empty_rows is not None:  # a fully masked row is NaN; an empty sequence reads nothing
        out[plan.empty_rows] = 0.0
    return out


def _sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqPages, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V as [Hkv, L, D] in ``dtype``: a view of the cache when its
    pages are consecutive and it holds ``dtype`` (no copy), else gathered (or converted)."""
    if seq.first_page >= 0:  # one strided view per cache (the caches are contiguous)
        k, v = _token_view(k_cache, seq), _token_view(v_cache, seq)
    else:
        k, v = gather_kv(k_cache, v_cache, seq.pages)  # [count * page, Hkv, D]
        k, v = k[: seq.length].transpose(0, 1), v[: seq.length].transpose(0, 1)
    return _in_dtype(k, dtype), _in_dtype(v, dtype)


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` read in the activations' dtype (a float16 cache of float32 activations)."""
    return t if t.dtype == dtype else t.to(dtype)


def _token_view(cache: torch.Tensor, seq: SeqPages) -> torch.Tensor:
    """[Hkv, L, D] view of the first L tokens from page ``seq.first_page`` of a contiguous
    cache [P, page, Hkv, D] (consecutive pages hold consecutive tokens)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    token = num_kv_heads * head_dim  # elements per token
    start = cache.storage_offset() + seq.first_page * cache.shape[1] * token
    return cache.as_strided((num_kv_heads, seq.length, head_dim), (head_dim, token, 1), start)


def _attend_one(
    q_row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqPages, scale: float
) -> torch.Tensor:
    """q_row [Hq, D] over one sequence's cached tokens -> [Hkv, G, D]."""
    num_q_heads, head_dim = q_row.shape
    num_kv_heads = k_cache.shape[2]
    k, v = _sequence_kv(k_cache, v_cache, seq, q_row.dtype)  # [Hkv, L, D]
    qg = q_row.view(num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [Hkv, G, D]
    if q_row.dtype == torch.float32 and not q_row.is_cuda:
        # A few query rows per KV head: two small bmm's beat SDPA's per-call setup on CPU.
        scores = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)  # [Hkv, G, L]
        return torch.bmm(torch.softmax(scores, dim=-1), v)  # [Hkv, G, D]
    return F.scaled_dot_product_attention(qg, k, v, scale=scale)


def _decode_each(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodeReadPlan,
    scale: float,
) -> torch.Tensor:
    """One sequence at a time, each reading only its own pages."""
    batch, num_q_heads, head_dim = q.shape
    if batch == 1 and len(plan.seqs) == 1:  # single stream: no output buffer to fill
        return _attend_one(q[0], k_cache, v_cache, plan.seqs[0], scale).reshape(q.shape)
    out = torch.zeros_like(q)
    for seq in plan.seqs:
        o = _attend_one(q[seq.row], k_cache, v_cache, seq, scale)
        out[seq.row] = o.reshape(num_q_heads, head_dim)
    return out


def serial_decode(reads: DecodeReadPlan, k_cache: torch.Tensor) -> bool:
    """Whether a CPU decode step's attention should run on one intra-op thread.

    Decode attention is a few small ``bmm``/softmax calls (or one SDPA) per layer. On two
    threads each call opens a parallel region whose barrier waits for the second thread; on a
    shared machine that thread is often descheduled, and the call waits a scheduler slice.
    Measured (SmolLM2 shapes, one sequence, bmm + softmax + bmm, load ~4 on 2 cores): at 300
    tokens 121 us median on 1 thread vs 12 ms on 2; at 4000 tokens 3.6 ms vs 11 ms; at 8000
    3.0 ms (min) vs 23 ms; 8 sequences of 300 tokens (padded SDPA) 1.1 ms vs 23 ms. The best
    runs (min) of 2 threads were never better than 1 thread by more than ~20%.
    """
    if k_cache.device.type != "cpu":
        return False
    if reads.pages is not None:
        tokens = reads.pages.shape[0] * reads.padded_len
    else:
        tokens = sum(seq.length for seq in reads.seqs)
    token_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # K and V
    return tokens * token_bytes <= SERIAL_DECODE_BYTES


def padded_page_limit(k_cache: torch.Tensor) -> int | None:
    """The most pages a padded decode gather may copy per call: no limit off CPU float32; on
    CPU float32 (or a float16 cache of float32 activations) the pages of ``PADDED_GATHER_BYTES``
    of K and V (see the module doc)."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in (torch.float32, torch.float16):
        return None
    page_bytes = 2 * k_cache[0].numel() * k_cache.element_size()  # one page of K and of V
    return PADDED_GATHER_BYTES // page_bytes


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    reads: DecodeReadPlan | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] over paged K/V -> [B, Hq, D] in q's dtype (inputs already checked).

    ``reads``: the step's read plan from ``decode_read_plan`` (None: derived here).
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    plan = reads
    if plan is None:
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        limit = padded_page_limit(k_cache)
        plan = decode_read_plan(block_table, seq_lens, page_size, num_pages, True, limit)
    if plan.pages is not None:
        return _decode_padded(q, k_cache, v_cache, plan, scale)
    return _decode_each(q, k_cache, v_cache, plan, scale)


def _causal_mask(n_new: int, total: int, device: torch.device) -> torch.Tensor:
    """[n_new, total] bool: new token i (position total - n_new + i) sees keys <= its position."""
    query_pos = torch.arange(total - n_new, total, device=device)
    return torch.arange(total, device=device)[None, :] <= query_pos[:, None]


def _attend_few(
    q_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: SeqPages, scale: float
) -> torch.Tensor:
    """q_new [n, Hq, D], the last n of seq.length tokens, over its cached K/V (causal)
    -> [n, Hq, D]. GQA folds into the query axis: [Hkv, n * G, D] rows per KV head."""
    n, num_q_heads, head_dim = q_new.shape
    num_kv_heads = k_cache.shape[2]
    group, length = num_q_heads // num_kv_heads, seq.length
    k, v = _sequence_kv(k_cache, v_cache, seq, q_new.dtype)  # [Hkv, L, D]
    qg = q_new.view(n, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)  # [Hkv, n, G, D]
    scores = torch.bmm(qg.reshape(num_kv_heads, n * group, head_dim), k.transpose(1, 2))
    scores = scores.mul_(scale).view(num_kv_heads, n, group, length)  # [Hkv, n, G, L]
    future = ~_causal_mask(n, length, q_new.device)  # [n, L]
    scores.masked_fill_(future[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores.view(num_kv_heads, n * group, length), dim=-1)
    out = torch.bmm(probs, v).view(num_kv_heads, n, group, head_dim)  # [Hkv, n, G, D]
    return out.permute(1, 0, 2, 3).reshape(n, num_q_heads, head_dim)


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
    few_rows_fast = q.dtype == torch.float32 and not q.is_cuda
    for b, total in enumerate(seq_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        if few_rows_fast and end - start <= FEW_NEW_TOKENS:
            seq = _seq_pages(block_table, b, total, page_size, k_cache.shape[0])
            out[start:end] = _attend_few(q[start:end], k_cache, v_cache, seq, scale)
            continue
        k, v = gather_kv(k_cache, v_cache, block_table[b, : -(-total // page_size)])
        k, v = _in_dtype(k[:total], q.dtype), _in_dtype(v[:total], q.dtype)
        out[start:end] = _causal_sdpa(q[start:end], k, v, scale)
    return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], the last n of L tokens, over k, v [L, Hkv, D], causal -> [n, Hq, D].

    Shaped so that SDPA runs its fused (flash) kernel, not its math path, which materialises
    the scores and a masked softmax (measured on CPU at n=100, L=2000: 9.4 vs 4.2 ms): 4-D
    inputs and no boolean mask. A chunk that starts at position 0 is plain causal attention;
    one after a cached prefix puts the G query heads of a KV head in the batch axis
    ([G, Hkv, n, D] against K/V expanded without a copy) under an additive mask of the offset
    causal pattern, shared by every layer of the step.
    """
    n, num_q_heads, head_dim = q.shape
    length, num_kv_heads = k.shape[0], k.shape[1]
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
    if n == length:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kt, vt, is_causal=True, scale=scale, enable_gqa=True
        )  # [1, Hq, n, D]
        return o[0].transpose(0, 1)
    group = num_q_heads // num_kv_heads
    batched = q.view(n, num_kv_heads, group, head_dim).permute(2, 1, 0, 3)  # [G, Hkv, n, D]
    shape = (group, num_kv_heads, length, head_dim)
    mask = _offset_causal_bias(n, length, q.dtype, q.device)
    o = F.scaled_dot_product_attention(
        batched, kt.expand(shape), vt.expand(shape), attn_mask=mask, scale=scale
    )  # [G, Hkv, n, D]
    return o.permute(2, 1, 0, 3).reshape(n, num_q_heads, head_dim)


@functools.lru_cache(maxsize=4)
def _offset_causal_bias(
    n_new: int, total: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[n_new, total]: 0 where new token i sees key j (j <= total - n_new + i), -inf elsewhere.
    Every layer of a step asks for the same one."""
    bias = torch.zeros(n_new, total, dtype=dtype, device=device)
    return bias.masked_fill_(~_causal_mask(n_new, total, device), float("-inf"))
