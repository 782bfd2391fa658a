"""Torch implementations of the small ops: the CPU runtime path and the GPU baseline."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class KeptSlots(NamedTuple):
    """The slots a store writes: negative ("skip") slots dropped once per step."""

    slots: torch.Tensor  # [T'] int64 slots to write
    keep: torch.Tensor | None  # [T] bool rows of k/v to write, None when every row is kept


def kept_slots(slot_mapping: torch.Tensor) -> KeptSlots:
    """slot_mapping [T] -> the slots to write and which rows they come from."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        return KeptSlots(slots[keep], keep)
    return KeptSlots(slots, None)


class RotaryAngles(NamedTuple):
    """cos/sin of each token's rotary angles, gathered once per step from the table."""

    cos: torch.Tensor  # [T, 1, D/2] float32
    sin: torch.Tensor  # [T, 1, D/2] float32
    rotation: torch.Tensor | None  # [T, 1, D/2] complex64 cos + i sin ("interleaved" only)


def rotary_angles(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, layout: str
) -> RotaryAngles:
    """positions [T] -> the angles ``rotary`` multiplies by in ``layout``."""
    cos, sin = _cos_sin(positions, cos_sin_cache)
    rotation = torch.complex(cos, sin) if layout == "interleaved" else None
    return RotaryAngles(cos, sin, rotation)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kept: KeptSlots | None = None,
) -> None:
    """Scatter k, v [T, Hkv, D] into the flat slots of the caches; negative slots are skipped.
    The caches hold k's dtype, or float16 (k and v are then rounded to it).

    ``kept``: ``kept_slots(slot_mapping)`` computed once for the step (None: computed here).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots, keep = kept if kept is not None else kept_slots(slot_mapping)
    if keep is not None:
        k, v = k[keep], v[keep]
    if k.dtype != k_cache.dtype:  # a float16 cache of float32 activations: rounded on store
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise over the last dim in float32; with a residual, normalise x + residual."""
    if residual is not None:
        x = x + residual
    xf, wf = x.float(), weight.float()  # no copies for float32 inputs
    # sum of squares as a dot product: on CPU a few small ops beat torch.rms_norm's setup cost
    # at one token per step
    mean_sq = torch.linalg.vecdot(xf, xf).unsqueeze_(-1).mul_(1.0 / x.shape[-1])  # [..., 1]
    normed = torch.mul(xf, mean_sq.add_(eps).rsqrt_()).mul_(wf)
    if normed.dtype != x.dtype:
        normed = normed.to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary_cache(
    max_positions: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_positions, head_dim]: first head_dim/2 columns cos, last head_dim/2 sin."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def _as_complex_pairs(xf: torch.Tensor) -> torch.Tensor:
    """float32 [..., D] -> complex64 [..., D/2] view of the pairs (x[2i], x[2i+1])."""
    pairs = torch.unflatten(xf, -1, (-1, 2))  # [..., D/2, 2]
    if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-2]):
        pairs = pairs.contiguous()  # a complex view needs even offsets and strides
    return torch.view_as_complex(pairs)


def _rotate_interleaved(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], rot [T, 1, D/2] complex (cos + i sin) -> rotated x in x's dtype."""
    rotated = _as_complex_pairs(x.float()) * rot  # [T, H, D/2] complex
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D/2] float32; pairs (x[i], x[i + D/2])."""
    xf = x.float()
    half = x.shape[-1] // 2
    a, b = xf[..., :half], xf[..., half:]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    first, second = out[..., :half], out[..., half:]
    torch.mul(a, cos, out=first).addcmul_(b, sin, value=-1.0)  # a cos - b sin
    torch.mul(b, cos, out=second).addcmul_(a, sin)  # b cos + a sin
    return out.to(x.dtype)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str,
    angles: RotaryAngles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions; out of place.

    ``angles``: ``rotary_angles(positions, cos_sin_cache, layout)`` computed once for the step.
    """
    if angles is None:
        angles = rotary_angles(positions, cos_sin_cache, layout)
    if layout == "interleaved":
        rot = angles.rotation  # [T, 1, D/2] complex
        if rot is None:
            rot = torch.complex(angles.cos, angles.sin)
        qk = _adjacent_heads(q, k)
        if qk is not None:  # q and k are neighbouring views of one fused projection: one pass
            rotated = _rotate_interleaved(qk, rot)  # [T, Hq + Hkv, D]
            return rotated[:, : q.shape[1]], rotated[:, q.shape[1] :]
        return _rotate_interleaved(q, rot), _rotate_interleaved(k, rot)
    return _rotate_half(q, angles.cos, angles.sin), _rotate_half(k, angles.cos, angles.sin)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, Hq + Hkv, D] view over q [T, Hq, D] and k [T, Hkv, D] when k's heads directly follow
    q's in memory (the Q and K parts of one fused QKV row), else None."""
    if q.dtype != k.dtype or q.device != k.device or q.shape[0] < 1:
        return None
    head_dim = q.shape[2]
    rows = (head_dim, 1)
    if q.stride()[1:] != rows or k.stride()[1:] != rows:
        return None
    if q.shape[0] > 1 and q.stride(0) != k.stride(0):  # a single row's stride is arbitrary
        return None
    if k.storage_offset() != q.storage_offset() + q.shape[1] * head_dim:
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    shape = (q.shape[0], q.shape[1] + k.shape[1], head_dim)
    return q.as_strided(shape, q.stride(), q.storage_offset())


def _cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, 1, D/2] float32."""
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, D]
    half = cos_sin.shape[-1] // 2
    return cos_sin[:, None, :half], cos_sin[:, None, half:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2F] -> silu(x[..., :F]) * x[..., F:] in x's dtype."""
    a, b = x.chunk(2, dim=-1)
    if x.dtype == torch.float32:
        return F.silu(a) * b
    return (F.silu(a.float()) * b.float()).to(x.dtype)
