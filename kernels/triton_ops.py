"""Triton kernels for the per-token ops: KV store, RMSNorm (+ residual), rotary, SiLU-and-mul.

Imported lazily by the public wrappers, which check shapes, dtypes and devices first. Math
is done in float32 and written back in the tensors' own dtype, like the torch path. Launches
pass ``enable_fp_fusion=True`` explicitly (Triton 3.9 warns when it is left to the default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One token: copy its [Hkv, D] K and V rows into flat slot ``slot`` (skip if < 0)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slots = tl.zeros([BLOCK_H], dtype=tl.int64) + slot  # the slot, broadcast over heads
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM) & (slots[:, None] >= 0)
    dst = slots[:, None] * (NUM_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton KV store; see ``kernels.store_kv``."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        enable_fp_fusion=True,
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    eps, hidden,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row: out = x / rms(x) * w; with a residual, x := x + res (stored as res_out) first."""
    row = tl.program_id(0).to(tl.int64) * hidden
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row + cols, mask=mask, other=0.0)  # sum in the input dtype
        tl.store(res_out_ptr + row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm; see ``kernels.rms_norm``."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()  # [rows, H]
    out = torch.empty_like(x2)
    res2 = residual.reshape(-1, hidden).contiguous() if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, res_out, eps, hidden,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
            enable_fp_fusion=True,
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, pos_ptr, cache_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cache,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr,
):
    """One (token, head): rotate the D/2 pairs of its row by the token position's angles."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    src = x_ptr + t * stride_xt + h * stride_xh
    a = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * stride_ot + h * stride_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(dst + first, (a * cos - b * sin).to(dtype), mask=mask)
    tl.store(dst + second, (b * cos + a * sin).to(dtype), mask=mask)


def _rotate(
    x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, layout: str
) -> torch.Tensor:
    """x [T, H, D] -> a new rotated tensor of the same shape and dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0 or num_heads == 0:
        return out
    _rotary_kernel[(num_tokens, num_heads)](
        x, out, positions, cache,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cache.stride(0),
        HALF=head_dim // 2, INTERLEAVED=layout == "interleaved",
        BLOCK=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=True,
    )
    return out


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rotary embedding; see ``kernels.rotary``."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    positions = positions.contiguous()
    q_rot = _rotate(q, positions, cos_sin_cache, layout)
    return q_rot, _rotate(k, positions, cos_sin_cache, layout)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr):
    """One (row, column block): out = silu(gate) * up, gate = x[:, :F], up = x[:, F:]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(gate))  # a stable sigmoid: never exp of a large positive number
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(out_ptr + row * width + cols, (gate * sigmoid * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-mul; see ``kernels.silu_and_mul``."""
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * width).contiguous()  # [rows, 2F]
    out = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(width, 1)))
    if x2.shape[0] > 0 and width > 0:
        grid = (x2.shape[0], triton.cdiv(width, block))
        _silu_and_mul_kernel[grid](x2, out, width, BLOCK=block, enable_fp_fusion=True)
    return out.view(*x.shape[:-1], width)
