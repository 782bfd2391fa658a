"""Torch implementations of the small ops: the CPU runtime path and the GPU baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k, v [T, Hkv, D] into the flat slots of the caches; negative slots are skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise over the last dim in float32; with a residual, normalise x + residual."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    normed = normed.to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary_cache(
    max_positions: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_positions, head_dim]: first head_dim/2 columns cos, last head_dim/2 sin."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D/2] float32 -> rotated x in x's dtype."""
    xf = x.float()
    if layout == "interleaved":
        pairs = xf.unflatten(-1, (-1, 2))  # [T, H, D/2, 2]
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.to(x.dtype)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions; out of place."""
    cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin, layout), _rotate(k, cos, sin, layout)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2F] -> silu(x[..., :F]) * x[..., F:] in x's dtype."""
    a, b = x.chunk(2, dim=-1)
    if x.dtype == torch.float32:
        return F.silu(a) * b
    return (F.silu(a.float()) * b.float()).to(x.dtype)
