"""Triton kernels for the per-token ops: KV store, RMSNorm (+ residual), rotary, SiLU-and-mul.

Imported lazily by the public wrappers, which check shapes, dtypes and devices first. Math
is done in float32 and written back in the tensors' own dtype, like the torch path. Launches
pass ``enable_fp_fusion=True`` explicitly (Triton 3.9 warns when it is left to the default).

Each program handles a block of rows (tokens). On CUDA a block is a few rows; in the CPU
interpreter (TRITON_INTERPRET=1), where every program costs interpreter overhead, it is 32 rows,
so a whole engine step runs as a handful of programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows_per_program(t: torch.Tensor, cuda_rows: int) -> int:
    """Rows one program handles: ``cuda_rows`` on CUDA, more in the CPU interpreter."""
    return cuda_rows if t.is_cuda else 32


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    """BLOCK_T tokens: copy each one's [Hkv, D] K and V into its flat slot (skip if < 0)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_HD)  # head * HEAD_DIM + dim
    h = j // HEAD_DIM
    d = j % HEAD_DIM
    t_mask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_mask, other=-1).to(tl.int64)
    mask = (t_mask & (slot >= 0))[:, None] & (j < NUM_HEADS * HEAD_DIM)[None, :]
    dst = slot[:, None] * (NUM_HEADS * HEAD_DIM) + j[None, :]
    rows = t.to(tl.int64)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton KV store; see ``paged_kernels.store_kv``."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_t = _rows_per_program(k, 1)
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_HD=triton.next_power_of_2(num_heads * head_dim),
        enable_fp_fusion=True,
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    eps, hidden, num_rows,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,
):
    """BLOCK_R rows: out = x / rms(x) * w; with a residual, x := x + res (stored as res_out)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    mask = (r < num_rows)[:, None] & (cols < hidden)[None, :]
    offs = r.to(tl.int64)[:, None] * hidden + cols[None, :]  # [BLOCK_R, BLOCK]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + offs, mask=mask, other=0.0)  # sum in the input dtype
        tl.store(res_out_ptr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / hidden + eps)  # [BLOCK_R]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    normed = xf * inv_rms[:, None] * w[None, :]
    tl.store(out_ptr + offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm; see ``paged_kernels.rms_norm``."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()  # [rows, H]
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, hidden).contiguous() if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    rows = x2.shape[0]
    if rows > 0:
        block_r = _rows_per_program(x, 1)
        _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x2, res2, weight.contiguous(), out, res_out, eps, hidden, rows,
            HAS_RESIDUAL=residual is not None, BLOCK_R=block_r,
            BLOCK=triton.next_power_of_2(hidden),
            enable_fp_fusion=True,
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _rotate_rows(
    src, dst, t, t_mask, cos, sin, stride_t, stride_h, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Rotate the [BLOCK_T, NUM_HEADS * HALF] pairs of rows t by their angles cos/sin."""
    j = tl.arange(0, BLOCK_J)  # head * HALF + pair
    h = j // HALF
    i = j % HALF
    mask = t_mask[:, None] & (j < NUM_HEADS * HALF)[None, :]
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    rows = t.to(tl.int64)[:, None]
    src_row = src + rows * stride_t + (h * stride_h)[None, :]
    a = tl.load(src_row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src_row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    dst_row = dst + rows * stride_ot + (h * stride_oh)[None, :]
    dtype = dst.dtype.element_ty
    tl.store(dst_row + first[None, :], (a * cos - b * sin).to(dtype), mask=mask)
    tl.store(dst_row + second[None, :], (b * cos + a * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_JQ: tl.constexpr, BLOCK_JK: tl.constexpr,
):
    """BLOCK_T tokens: rotate every q and k head of each by the token position's angles."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    pos = tl.load(pos_ptr + t, mask=t_mask, other=0).to(tl.int64)
    cos, sin = _angles(cache_ptr, pos, t_mask, stride_cache, NUM_Q_HEADS, HALF, BLOCK_JQ)
    _rotate_rows(q_ptr, q_out_ptr, t, t_mask, cos, sin,
                 stride_qt, stride_qh, stride_qot, stride_qoh,
                 NUM_Q_HEADS, HALF, INTERLEAVED, BLOCK_JQ)
    cos, sin = _angles(cache_ptr, pos, t_mask, stride_cache, NUM_K_HEADS, HALF, BLOCK_JK)
    _rotate_rows(k_ptr, k_out_ptr, t, t_mask, cos, sin,
                 stride_kt, stride_kh, stride_kot, stride_koh,
                 NUM_K_HEADS, HALF, INTERLEAVED, BLOCK_JK)


@triton.jit
def _angles(
    cache_ptr, pos, t_mask, stride_cache,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """cos, sin [BLOCK_T, BLOCK_J] float32 of each token's position, repeated for every head."""
    j = tl.arange(0, BLOCK_J)
    angle = pos[:, None] * stride_cache + (j % HALF)[None, :]
    mask = t_mask[:, None] & (j < NUM_HEADS * HALF)[None, :]
    cos = tl.load(cache_ptr + angle, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + angle + HALF, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rotary embedding; see ``paged_kernels.rotary``. q and k in one launch."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    positions = positions.contiguous()
    q_rot = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_rot = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return q_rot, k_rot
    half = head_dim // 2
    block_t = _rows_per_program(q, 1)
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        q, k, q_rot, k_rot, positions, cos_sin_cache, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_rot.stride(0), q_rot.stride(1), k_rot.stride(0), k_rot.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=half,
        INTERLEAVED=layout == "interleaved", BLOCK_T=block_t,
        BLOCK_JQ=triton.next_power_of_2(max(1, num_q_heads * half)),
        BLOCK_JK=triton.next_power_of_2(max(1, num_k_heads * half)),
        enable_fp_fusion=True,
    )
    return q_rot, k_rot


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, num_rows, BLOCK_R: tl.constexpr,
                         BLOCK: tl.constexpr):
    """BLOCK_R rows x one column block: out = silu(gate) * up, gate = x[:, :F], up = x[:, F:]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (r < num_rows)[:, None] & (cols < width)[None, :]
    rows = r.to(tl.int64)[:, None]
    src = x_ptr + rows * 2 * width + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(gate))  # a stable sigmoid: never exp of a large positive number
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(out_ptr + rows * width + cols[None, :],
             (gate * sigmoid * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-mul; see ``paged_kernels.silu_and_mul``."""
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * width).contiguous()  # [rows, 2F]
    rows = x2.shape[0]
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    block_r = _rows_per_program(x, 1)
    block = min(1024 if x.is_cuda else 4096, triton.next_power_of_2(max(width, 1)))
    if rows > 0 and width > 0:
        grid = (triton.cdiv(rows, block_r), triton.cdiv(width, block))
        _silu_and_mul_kernel[grid](
            x2, out, width, rows, BLOCK_R=block_r, BLOCK=block, enable_fp_fusion=True
        )
    return out.view(*x.shape[:-1], width)
