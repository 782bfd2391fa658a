"""Public per-token ops of a transformer layer: RMSNorm, rotary embedding, SiLU-and-mul."""

from __future__ import annotations

from typing import overload

import torch

from . import torch_ops
from .backend import resolve_backend
from .checks import (
    FLOAT_DTYPES,
    ROTARY_LAYOUTS,
    check_last_dim_contiguous,
    check_positions_fit,
    check_same_device,
    check_tensor,
)
from .plan import RotaryPlan


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: None = None,
    backend: str | None = None,
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., H] with weight [H]; math in float32.

    Without residual: returns norm(x) in x's dtype.
    With residual (same shape/dtype as x): s = x + residual; returns (norm(s), s), the fused
    residual add of a pre-norm transformer (s is the next layer's residual). Out of place.
    """
    check_tensor("x", x, x.dim(), FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} entries, x's last dim is {x.shape[-1]}")
    check_same_device(x=x, weight=weight)
    if residual is not None:
        check_tensor("residual", residual, x.dim(), (x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(
                f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
            )
        check_same_device(x=x, residual=residual)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if resolve_backend(backend, x) == "torch":
        return torch_ops.rms_norm(x, weight, float(eps), residual)
    from . import triton_ops

    return triton_ops.rms_norm(x, weight, float(eps), residual)


def rotary_cache(
    max_positions: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Build the cos/sin table for ``rotary``: [max_positions, head_dim] on CPU.

    Row p holds cos(p * f_i) for i < head_dim/2, then sin(p * f_i), with
    f_i = theta ** (-2i / head_dim). Move it to the model's device once.
    """
    if max_positions <= 0 or head_dim <= 0 or head_dim % 2:
        raise ValueError(
            f"need max_positions > 0 and an even head_dim > 0, got {max_positions}, {head_dim}"
        )
    if theta <= 0:
        raise ValueError(f"theta must be > 0, got {theta}")
    return torch_ops.rotary_cache(max_positions, head_dim, theta, dtype)


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str = "interleaved",
    backend: str | None = None,
    plan: RotaryPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q [T, Hq, D] and k [T, Hkv, D]; returns (q_rot, k_rot).

    positions [T] int64 (or int32); cos_sin_cache [max_pos, D] from ``rotary_cache``.
    layout "interleaved": pairs (x[2i], x[2i+1]), as GGUF stores Q/K weights;
    layout "half": pairs (x[i], x[i + D/2]), as Hugging Face checkpoints.
    ``plan``: the step's ``plan_rotary`` for these positions, table and layout.
    Out of place; outputs keep the inputs' dtypes.
    """
    if layout not in ROTARY_LAYOUTS:
        raise ValueError(f"layout must be one of {ROTARY_LAYOUTS}, got {layout!r}")
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("positions", positions, 1, (torch.int64, torch.int32))
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES)
    check_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    check_last_dim_contiguous(q=q, k=k, cos_sin_cache=cos_sin_cache)
    head_dim = q.shape[2]
    if k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q and k need one even head_dim, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[0] != positions.shape[0] or k.shape[0] != positions.shape[0]:
        raise ValueError(
            f"token counts differ: q {q.shape[0]}, k {k.shape[0]}, positions {positions.shape[0]}"
        )
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[1]} != head_dim {head_dim}")
    chosen = resolve_backend(backend, q)
    if plan is not None:
        plan.check_call(chosen, positions, cos_sin_cache, layout)
    else:
        check_positions_fit(positions, cos_sin_cache.shape[0])
    if chosen == "torch":
        angles = plan.angles if plan is not None else None
        return torch_ops.rotary(q, k, positions, cos_sin_cache, layout, angles)
    from . import triton_ops

    return triton_ops.rotary(q, k, positions, cos_sin_cache, layout)


def silu_and_mul(x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """x [..., 2F] -> silu(x[..., :F]) * x[..., F:] in x's dtype (the gated MLP activation)."""
    check_tensor("x", x, x.dim(), FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (2F), got shape {tuple(x.shape)}")
    check_last_dim_contiguous(x=x)
    if resolve_backend(backend, x) == "torch":
        return torch_ops.silu_and_mul(x)
    from . import triton_ops

    return triton_ops.silu_and_mul(x)
