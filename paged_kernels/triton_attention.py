"""Triton paged attention: split-K decode with GQA and causal prefill over cached pages.

Imported lazily by ``paged_kernels.attention`` (so ``TRITON_INTERPRET=1`` set before first use runs
these kernels on CPU tensors). Inputs are checked by the public wrappers; the launch helpers
here only assert the layout facts the kernels rely on.

Both kernels keep the online softmax in the log2 domain (``exp2`` with the scale pre-multiplied
by log2(e)) and use a finite ``NEG`` instead of -inf, so no inf - inf is ever formed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # "minus infinity" that stays finite under subtraction
LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # a decode split covers at least this many cache positions


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2, tokens_per_split,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_bt,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (sequence, KV head, split): the GROUP query heads over one range of the cache."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(block_table_ptr + b * stride_bt + n // PAGE_SIZE, mask=n_mask, other=0)
        row = page.to(tl.int64) * stride_kp + (n % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.where(n_mask[None, :], tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, m_i + tl.log2(l_safe), NEG)  # log2-sum-exp2 of this split's scores
    head_off = b * stride_mob + heads * stride_moh + split * stride_mos
    tl.store(
        mid_o_ptr + head_off[:, None] + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :]
    )
    tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, num_splits,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sequence, query head): weight each split's output by exp2 of its log-sum-exp."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=s_mask, other=NEG)
    live = s_mask & (lse > NEG * 0.5)  # splits that saw at least one token
    m = tl.max(lse, 0)
    w = tl.where(live, tl.exp2(lse - m), 0.0)  # [BLOCK_S]
    o = tl.load(
        mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
        mask=live[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_table_ptr, cu_seqlens_ptr, seq_lens_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (sequence, KV head, block of BLOCK_T new tokens): causal attention over its pages.

    The GROUP query heads sharing the KV head are folded into the rows, so each K/V block is
    loaded once for all of them: row r is token r // BLOCK_G, query head r % BLOCK_G.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    t_block = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + b)
    n_new = tl.load(cu_seqlens_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - n_new

    r = tl.arange(0, BLOCK_T * BLOCK_G)
    i = t_block * BLOCK_T + r // BLOCK_G  # index of the new token within its sequence
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    row_mask = (i < n_new) & (g < GROUP)
    d_mask = d < HEAD_DIM
    pos = prefix + i  # absolute position of each row's token
    q_rows = (q_start + i).to(tl.int64) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0
    )  # [BLOCK_T * BLOCK_G, BLOCK_D]
    # keys up to the last token's position; nothing at all when this block has no tokens
    kv_end = tl.minimum(seq_len, prefix + (t_block + 1) * BLOCK_T)
    kv_end = tl.where(t_block * BLOCK_T < n_new, kv_end, 0)

    m_i = tl.full([BLOCK_T * BLOCK_G], NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        page = tl.load(block_table_ptr + b * stride_bt + n // PAGE_SIZE, mask=n_mask, other=0)
        row = page.to(tl.int64) * stride_kp + (n % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = row_mask[:, None] & n_mask[None, :] & (n[None, :] <= pos[:, None])
        s = tl.where(visible, s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = (q_start + i).to(tl.int64) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(
        o_ptr + o_rows[:, None] + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _target_programs(device: torch.device) -> int:
    """How many decode programs keep the device busy (a few waves of SMs on CUDA)."""
    if device.type == "cuda":
        return 8 * _sm_count(device.index or 0)
    return 8  # interpreter: a few splits, so split-K is exercised without slowing tests


def plan_splits(
    batch: int,
    num_kv_heads: int,
    capacity: int,
    block_n: int,
    device: torch.device,
    requested: int | None = None,
) -> tuple[int, int]:
    """Return (num_splits, tokens_per_split) for a cache of ``capacity`` positions per sequence.

    Sized from the block table width, not the actual lengths, so no host sync is needed;
    splits past a sequence's length exit at once and merge with weight zero. Each split
    covers a whole number of ``block_n`` blocks.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"num_splits must be >= 1, got {requested}")
        splits = requested
    else:
        wanted = -(-_target_programs(device) // max(1, batch * num_kv_heads))
        splits = max(1, min(wanted, -(-capacity // MIN_SPLIT_TOKENS)))
    tokens = -(-max(1, -(-capacity // splits)) // block_n) * block_n
    return -(-capacity // tokens), tokens


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products ("ieee", not TF32); 16-bit inputs use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, int(triton.next_power_of_2(head_dim)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton decode attention; see ``paged_kernels.paged_decode_attention`` for the contract.

    ``num_splits`` overrides the split-K plan (tests use it to force several splits).
    """
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_table.stride(-1) == 1 and seq_lens.is_contiguous()
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_n = 64
    capacity = block_table.shape[1] * page_size
    splits, tokens = plan_splits(batch, num_kv_heads, capacity, block_n, q.device, num_splits)
    mid_o = q.new_empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32)
    mid_lse = q.new_empty((batch, num_q_heads, splits), dtype=torch.float32)
    block_d = _block_d(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse,
        scale * LOG2E, tokens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4,
        enable_fp_fusion=True,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, out, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
        num_warps=2,
        enable_fp_fusion=True,
    )
    return out


def _max_new_tokens(cu_seqlens_q: torch.Tensor, total: int) -> int:
    """Longest chunk of new tokens: exact on CPU, the sync-free bound T on CUDA."""
    if cu_seqlens_q.is_cuda:
        return total
    return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Triton prefill/extend attention; see ``paged_kernels.paged_prefill_attention``.

    ``max_new_tokens``: the longest chunk, known on the host (sizes the grid without reading
    cu_seqlens_q back from the device); None derives it.
    """
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_table.stride(-1) == 1 and seq_lens.is_contiguous()
    assert cu_seqlens_q.is_contiguous()
    total, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    max_new = _max_new_tokens(cu_seqlens_q, total) if max_new_tokens is None else max_new_tokens
    if total == 0 or max_new == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_d = _block_d(head_dim)
    rows = 64 if q.is_cuda else 32  # query rows (token x head) per program
    block_t = max(1, rows // block_g)
    block_n = 64 if block_d <= 64 else 32
    if block_t * block_g < 16:  # tl.dot needs at least 16 rows
        block_t = 16 // block_g
    grid = (seq_lens.shape[0], num_kv_heads, -(-max_new // block_t))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_table, cu_seqlens_q, seq_lens,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4,
        enable_fp_fusion=True,
    )
    return out


__all__ = ["paged_decode_attention", "paged_prefill_attention", "plan_splits"]
