"""Step plans: one engine step's metadata checked and preprocessed once, shared by every layer.

A step runs the same ops in every layer over the same metadata tensors (block table, lengths,
cu_seqlens, slots, positions). ``plan_attention`` and ``plan_rotary`` check those tensors' values
once and derive what the chosen backend needs (the torch decode read plan, the slots a store
keeps, the longest chunk, the rotary angles). The engine carries the plans explicitly (on its
attention metadata) and passes them as ``plan=`` to the ops; an op given a plan checks that it
was built for the very tensors, cache geometry and backend of the call, then skips the value
checks. No state is kept anywhere else.

Contract: the caller does not modify a planned tensor while its plan is in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import torch_attention, torch_ops
from .backend import Backend, resolve_backend
from .checks import (
    ROTARY_LAYOUTS,
    check_block_table_values,
    check_cu_seqlens_values,
    check_kv_cache,
    check_positions_fit,
    check_same_device,
    check_slots_fit,
    check_tensor,
)
from .torch_attention import DecodeReadPlan
from .torch_ops import KeptSlots, RotaryAngles


@dataclass(frozen=True, slots=True, eq=False)
class AttentionPlan:
    """The checked attention metadata of one step and what the backend derived from it.

    ``decode_reads`` and ``kept_slots`` are the torch path's (None for Triton, and
    ``decode_reads`` also None for a step that is not a decode step).
    """

    backend: Backend
    block_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    slot_mapping: torch.Tensor  # [T] int32/int64
    num_pages: int
    page_size: int
    kv_dtype: torch.dtype
    max_new_tokens: int  # longest chunk of new tokens of one sequence (an upper bound on CUDA)
    is_decode: bool  # one new token per sequence: the step runs paged_decode_attention
    decode_reads: DecodeReadPlan | None
    kept_slots: KeptSlots | None

    def check_call(self, backend: Backend, k_cache: torch.Tensor, **tensors: torch.Tensor) -> None:
        """Raise ValueError unless this plan was built for ``tensors`` (by name), ``k_cache``'s
        geometry and dtype, and ``backend``."""
        if backend != self.backend:
            raise ValueError(f"plan built for backend {self.backend!r}, op runs {backend!r}")
        geometry = (k_cache.shape[0], k_cache.shape[1], k_cache.dtype)
        if geometry != (self.num_pages, self.page_size, self.kv_dtype):
            raise ValueError(
                f"plan built for a cache of {self.num_pages} pages x {self.page_size} "
                f"{self.kv_dtype}, got {geometry[0]} x {geometry[1]} {geometry[2]}"
            )
        for name, t in tensors.items():
            if t is not getattr(self, name):
                raise ValueError(f"plan built for another {name} tensor than the one passed")


def plan_attention(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    *,
    is_decode: bool = False,
    backend: str | None = None,
    max_new_tokens: int | None = None,
) -> AttentionPlan:
    """Check one step's attention metadata against a cache like ``k_cache`` and plan its reads.

    Shapes: see ``paged_kernels.paged_prefill_attention`` and ``paged_kernels.store_kv``; T (new
    tokens) is ``slot_mapping.shape[0]``. Values are checked on CPU (on CUDA nothing is read back,
    so a plan never syncs with the device). ``max_new_tokens``: the longest chunk, when the caller
    knows it on the host; otherwise derived on CPU, bounded by T on CUDA. ``is_decode``: the
    step runs ``paged_decode_attention`` (the torch path then plans its decode reads).
    """
    _, page_size, _, _ = check_kv_cache(k_cache, k_cache)
    num_pages = k_cache.shape[0]
    chosen = resolve_backend(backend, k_cache)
    check_tensor("seq_lens", seq_lens, 1)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    check_same_device(
        k_cache=k_cache, block_table=block_table, seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q, slot_mapping=slot_mapping,
    )  # fmt: skip
    check_block_table_values(block_table, seq_lens, page_size, num_pages)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q must have B+1 = {seq_lens.shape[0] + 1} entries, "
            f"got {cu_seqlens_q.shape[0]}"
        )
    total = slot_mapping.shape[0]
    check_cu_seqlens_values(cu_seqlens_q, seq_lens, total)
    check_slots_fit(slot_mapping, num_pages * page_size)
    torch_path = chosen == "torch"
    reads = None
    if torch_path and is_decode and total > 0:
        limit = torch_attention.padded_page_limit(k_cache)
        reads = torch_attention.decode_read_plan(
            block_table, seq_lens, page_size, num_pages, True, limit
        )
    return AttentionPlan(
        backend=chosen,
        block_table=block_table,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        slot_mapping=slot_mapping,
        num_pages=num_pages,
        page_size=page_size,
        kv_dtype=k_cache.dtype,
        max_new_tokens=_longest_chunk(cu_seqlens_q, total, max_new_tokens),
        is_decode=is_decode,
        decode_reads=reads,
        kept_slots=torch_ops.kept_slots(slot_mapping) if torch_path else None,
    )


def _longest_chunk(cu_seqlens_q: torch.Tensor, total: int, hint: int | None) -> int:
    if hint is not None:
        if not 0 <= hint <= total:
            raise ValueError(f"max_new_tokens must lie in [0, T={total}], got {hint}")
        return hint
    if cu_seqlens_q.is_cuda or cu_seqlens_q.shape[0] < 2:
        return total if cu_seqlens_q.shape[0] >= 2 else 0
    return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())


@dataclass(frozen=True, slots=True, eq=False)
class RotaryPlan:
    """One step's checked positions and, on the torch path, their angles."""

    backend: Backend
    positions: torch.Tensor  # [T] int64/int32
    cos_sin_cache: torch.Tensor  # [max_pos, D]
    layout: str
    angles: RotaryAngles | None  # torch path only

    def check_call(
        self, backend: Backend, positions: torch.Tensor, cos_sin_cache: torch.Tensor, layout: str
    ) -> None:
        """Raise ValueError unless this plan was built for exactly these inputs."""
        if backend != self.backend:
            raise ValueError(f"plan built for backend {self.backend!r}, op runs {backend!r}")
        if positions is not self.positions or cos_sin_cache is not self.cos_sin_cache:
            raise ValueError("rotary plan built for other positions or another cos/sin table")
        if layout != self.layout:
            raise ValueError(f"rotary plan built for layout {self.layout!r}, got {layout!r}")


def plan_rotary(
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str = "interleaved",
    *,
    backend: str | None = None,
) -> RotaryPlan:
    """Check one step's positions against the table and gather their angles (torch path)."""
    if layout not in ROTARY_LAYOUTS:
        raise ValueError(f"layout must be one of {ROTARY_LAYOUTS}, got {layout!r}")
    check_tensor("positions", positions, 1, (torch.int64, torch.int32))
    check_tensor("cos_sin_cache", cos_sin_cache, 2)
    check_same_device(positions=positions, cos_sin_cache=cos_sin_cache)
    check_positions_fit(positions, cos_sin_cache.shape[0])
    chosen = resolve_backend(backend, cos_sin_cache)
    angles = None
    if chosen == "torch":
        angles = torch_ops.rotary_angles(positions, cos_sin_cache, layout)
    return RotaryPlan(chosen, positions, cos_sin_cache, layout, angles)


__all__ = ["AttentionPlan", "RotaryPlan", "plan_attention", "plan_rotary"]
