"""The per-layer ops of one planned engine step, checked once per step instead of once per call.

A decoder layer runs a handful of small ops per step: RMSNorm with its residual add, rotary on
the Q/K rows of the fused QKV projection, the KV store, attention, SiLU-and-mul. The public ops
of ``paged_kernels`` check every input on every call; at one token per step in a 30-layer model
those checks and the dispatch around them cost about as much as the ops themselves. ``plan_step``
checks one step once: its metadata values (an ``AttentionPlan``), its positions (a
``RotaryPlan``), every layer's KV cache and the layer geometry. The ``StepOps`` it returns runs
the ops of every layer without checking again.

Contract (the caller is the model, whose tensors have fixed shapes): ``qkv`` is one layer's
fused projection [T, (Hq + 2 Hkv) * D], row-contiguous, in the step's dtype and on its device,
and owned by the caller (the torch path rotates its Q/K part in place); ``k_cache`` /
``v_cache`` are caches that ``plan_step`` checked; norm weights are [hidden] vectors of the
model. Nothing is validated per call: bad shapes fail inside torch or Triton, not with a
``paged_kernels`` message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import torch_attention, torch_ops
from .checks import FLOAT_DTYPES, check_heads, check_kv_cache, check_same_device, kv_storage_ok
from .plan import AttentionPlan, RotaryPlan


class LayerGeometry(NamedTuple):
    """The attention shape and constants every layer of the model shares."""

    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    rms_eps: float
    scale: float  # softmax scale of attention


class QKV(NamedTuple):
    """One layer's rotated queries and keys and its values."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]


class NormedResidual(NamedTuple):
    """RMSNorm of the updated residual stream, and that stream."""

    normed: torch.Tensor  # [T, hidden]
    residual: torch.Tensor  # [T, hidden]


@dataclass(frozen=True, slots=True, eq=False)
class StepOps(ABC):
    """One step's checked plans and geometry, with the layer ops that trust their inputs."""

    attention: AttentionPlan
    rotary: RotaryPlan
    geometry: LayerGeometry

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> NormedResidual:
        """s = x + residual (s = x when residual is None); returns (rms_norm(s) * weight, s)."""

    @abstractmethod
    def split_rotate(self, qkv: torch.Tensor) -> QKV:
        """The Q, K, V heads of a fused projection [T, (Hq + 2 Hkv) * D], Q and K rotated."""

    @abstractmethod
    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Write k, v [T, Hkv, D] into the step's slots of one layer's caches."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """q [T, Hq, D] from ``split_rotate`` over one layer's paged K/V -> [T, Hq, D]."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2F] -> silu(x[:, :F]) * x[:, F:]."""


def _heads(qkv: torch.Tensor, start: int, heads: int, head_dim: int) -> torch.Tensor:
    """[T, heads, D] view of the columns start.. of qkv [T, width] (one call, no slicing)."""
    shape = (qkv.shape[0], heads, head_dim)
    return qkv.as_strided(shape, (qkv.stride(0), head_dim, 1), qkv.storage_offset() + start)


@dataclass(frozen=True, slots=True, eq=False)
class TorchStepOps(StepOps):
    """The CPU runtime path. In float32 the rotary runs in place on the projection's Q/K
    columns (one complex multiply for "interleaved", three ops for "half"), and RMSNorm is
    torch's fused ``rms_norm``; other dtypes use ``torch_ops``' out-of-place references."""

    # "half" layout, float32: [T, 1, D] (cos, cos) and (-sin, sin) (None otherwise)
    cos2: torch.Tensor | None
    sin2: torch.Tensor | None
    in_place: bool  # float32 activations: rotate in place, fused RMSNorm
    serial_decode: bool  # decode attention on one intra-op thread (``torch_attention``)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> NormedResidual:
        s = x if residual is None else x + residual
        eps = self.geometry.rms_eps
        if self.in_place:
            return NormedResidual(torch.rms_norm(s, (s.shape[-1],), weight, eps), s)
        normed = torch_ops.rms_norm(s, weight, eps, None)
        assert isinstance(normed, torch.Tensor)
        return NormedResidual(normed, s)

    def split_rotate(self, qkv: torch.Tensor) -> QKV:
        hq, hkv, d = self.geometry.num_heads, self.geometry.num_kv_heads, self.geometry.head_dim
        q, k = _heads(qkv, 0, hq, d), _heads(qkv, hq * d, hkv, d)
        v = _heads(qkv, (hq + hkv) * d, hkv, d)
        if not self.in_place:
            angles, rot = self.rotary.angles, self.rotary
            q, k = torch_ops.rotary(q, k, rot.positions, rot.cos_sin_cache, rot.layout, angles)
            return QKV(q, k, v)
        qk = _heads(qkv, 0, hq + hkv, d)  # [T, Hq + Hkv, D]: Q and K heads are neighbours
        if self.cos2 is None:  # interleaved pairs (x[2i], x[2i+1]) as complex numbers
            assert self.rotary.angles is not None and self.rotary.angles.rotation is not None
            pairs = qk.view(qk.shape[0], hq + hkv, d // 2, 2)  # [T, Hq + Hkv, D/2, 2]
            torch.view_as_complex(pairs).mul_(self.rotary.angles.rotation)
        else:  # halves: x * (cos, cos) + (x2, x1) * (-sin, sin)
            assert self.sin2 is not None
            rotated = torch.mul(qk, self.cos2).addcmul_(qk.roll(d // 2, -1), self.sin2)
            qk.copy_(rotated)
        return QKV(q, k, v)

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        plan = self.attention
        torch_ops.store_kv(k, v, k_cache, v_cache, plan.slot_mapping, plan.kept_slots)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        plan, scale = self.attention, self.geometry.scale
        if not plan.is_decode:
            return torch_attention.paged_prefill_attention(
                q, k_cache, v_cache, plan.block_table, plan.cu_seqlens_q, plan.seq_lens, scale
            )
        if not self.serial_decode:
            return self._decode(q, k_cache, v_cache)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._decode(q, k_cache, v_cache)
        finally:
            torch.set_num_threads(threads)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        plan = self.attention
        return torch_attention.paged_decode_attention(
            q, k_cache, v_cache, plan.block_table, plan.seq_lens, self.geometry.scale,
            plan.decode_reads,
        )  # fmt: skip

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ops.silu_and_mul(x)


@dataclass(frozen=True, slots=True, eq=False)
class TritonStepOps(StepOps):
    """The CUDA path (and the CPU interpreter): the Triton kernels, without per-call checks."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> NormedResidual:
        from . import triton_ops

        eps = self.geometry.rms_eps
        if residual is None:
            normed = triton_ops.rms_norm(x, weight, eps, None)
            assert isinstance(normed, torch.Tensor)
            return NormedResidual(normed, x)
        pair = triton_ops.rms_norm(x, weight, eps, residual)
        assert isinstance(pair, tuple)
        return NormedResidual(*pair)

    def split_rotate(self, qkv: torch.Tensor) -> QKV:
        from . import triton_ops

        hq, hkv, d = self.geometry.num_heads, self.geometry.num_kv_heads, self.geometry.head_dim
        q, k = _heads(qkv, 0, hq, d), _heads(qkv, hq * d, hkv, d)
        rot = self.rotary
        q, k = triton_ops.rotary(q, k, rot.positions, rot.cos_sin_cache, rot.layout)
        return QKV(q, k, _heads(qkv, (hq + hkv) * d, hkv, d))

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        from . import triton_ops

        triton_ops.store_kv(k, v, k_cache, v_cache, self.attention.slot_mapping)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        from . import triton_attention

        plan, scale = self.attention, self.geometry.scale
        if plan.is_decode:
            return triton_attention.paged_decode_attention(
                q, k_cache, v_cache, plan.block_table, plan.seq_lens, scale
            )
        return triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, plan.block_table, plan.cu_seqlens_q, plan.seq_lens, scale,
            plan.max_new_tokens,
        )  # fmt: skip

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        from . import triton_ops

        return triton_ops.silu_and_mul(x)


def _check_caches(
    plan: AttentionPlan, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]
) -> None:
    """Every layer's K and V cache has the planned geometry, layout, dtype and device."""
    if not k_caches or len(k_caches) != len(v_caches):
        raise ValueError(
            f"need one K and one V cache per layer, got {len(k_caches)} and {len(v_caches)}"
        )
    first = k_caches[0]
    check_kv_cache(first, v_caches[0])
    check_same_device(k_cache=first, slot_mapping=plan.slot_mapping)
    for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
        for name, cache in (("k", k), ("v", v)):
            same = cache.shape == first.shape and cache.dtype == first.dtype
            if not (same and cache.device == first.device and cache.is_contiguous()):
                raise ValueError(
                    f"layer {i} {name}_cache is {tuple(cache.shape)} {cache.dtype} on "
                    f"{cache.device} (contiguous={cache.is_contiguous()}), expected "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}, contiguous"
                )


def _check_geometry(
    geometry: LayerGeometry, k_cache: torch.Tensor, rotary: RotaryPlan, dtype: torch.dtype
) -> None:
    """Head counts, head_dim, constants and dtype agree with the caches and the rotary table."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_heads(geometry.num_heads, geometry.num_kv_heads)
    if (geometry.num_kv_heads, geometry.head_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"layers have {geometry.num_kv_heads} KV heads of {geometry.head_dim}, the caches "
            f"hold {num_kv_heads} of {head_dim}"
        )
    if rotary.cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache width {rotary.cos_sin_cache.shape[1]} != head_dim {head_dim}"
        )
    if geometry.rms_eps <= 0 or geometry.scale <= 0:
        raise ValueError(f"rms_eps and scale must be > 0, got {geometry[3:]}")
    if dtype not in FLOAT_DTYPES or not kv_storage_ok(dtype, k_cache):
        raise TypeError(f"activations are {dtype}, the KV cache is {k_cache.dtype}")


def plan_step(
    attention: AttentionPlan,
    rotary: RotaryPlan,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    geometry: LayerGeometry,
    dtype: torch.dtype,
) -> StepOps:
    """Check a step once and bind its layer ops.

    ``attention`` and ``rotary`` (from ``plan_attention`` / ``plan_rotary``: their values are
    already checked) must share a backend and a token count; every cache must match
    ``attention``'s geometry; ``geometry`` must match the caches; ``dtype`` is the activations'
    (the caches' dtype). Raises ValueError/TypeError otherwise.
    """
    if attention.backend != rotary.backend:
        raise ValueError(
            f"attention planned for {attention.backend!r}, rotary for {rotary.backend!r}"
        )
    tokens = attention.slot_mapping.shape[0]
    if rotary.positions.shape[0] != tokens:
        raise ValueError(f"{rotary.positions.shape[0]} positions for a step of {tokens} tokens")
    batch = attention.seq_lens.shape[0]
    if attention.is_decode and tokens != batch:
        raise ValueError(f"a decode step has one token per sequence, got {tokens} for {batch}")
    _check_caches(attention, k_caches, v_caches)
    attention.check_call(attention.backend, k_caches[0])
    _check_geometry(geometry, k_caches[0], rotary, dtype)
    check_same_device(k_cache=k_caches[0], positions=rotary.positions)
    if attention.backend == "triton":
        if dtype != k_caches[0].dtype:
            raise TypeError(f"the Triton path reads a cache of the activations' dtype {dtype}, "
                            f"got {k_caches[0].dtype}")
        return TritonStepOps(attention, rotary, geometry)
    return _torch_step_ops(attention, rotary, geometry, dtype, k_caches)


def _torch_step_ops(
    attention: AttentionPlan,
    rotary: RotaryPlan,
    geometry: LayerGeometry,
    dtype: torch.dtype,
    k_caches: Sequence[torch.Tensor],
) -> TorchStepOps:
    in_place = dtype == torch.float32
    cos2 = sin2 = None
    if in_place and rotary.layout == "half":
        assert rotary.angles is not None
        cos, sin = rotary.angles.cos, rotary.angles.sin  # [T, 1, D/2]
        cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
    reads, first = attention.decode_reads, k_caches[0]
    serial = reads is not None and torch_attention.serial_decode(reads, first)
    return TorchStepOps(attention, rotary, geometry, cos2, sin2, in_place, serial)


__all__ = ["QKV", "LayerGeometry", "NormedResidual", "StepOps", "plan_step"]
