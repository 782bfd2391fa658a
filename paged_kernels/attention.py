"""Public paged-attention ops and the KV-cache store, dispatched by backend.

KV layout: ``k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim]``, contiguous,
page size a power of two >= 8. Token ``t`` of sequence ``b`` lives in page
``block_table[b, t // page_size]`` at offset ``t % page_size``; its flat slot is
``page * page_size + offset``.
"""

from __future__ import annotations

import torch

from . import torch_attention, torch_ops
from .backend import Backend, resolve_backend
from .checks import (
    FLOAT_DTYPES,
    check_block_table_values,
    check_cu_seqlens_values,
    check_heads,
    check_kv_cache,
    check_kv_storage,
    check_last_dim_contiguous,
    check_same_device,
    check_same_dtype,
    check_slots_fit,
    check_tensor,
)
from .plan import AttentionPlan


def _check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Shapes, dtypes, devices and layout of an attention call (no values are read)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("seq_lens", seq_lens, 1)
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_kv_storage("q", q, k_cache)
    check_same_device(q=q, k_cache=k_cache, block_table=block_table, seq_lens=seq_lens)
    check_last_dim_contiguous(q=q)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    check_heads(q.shape[1], num_kv_heads)
    if not isinstance(scale, float | int) or scale <= 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")


def _check_or_plan(
    plan: AttentionPlan | None,
    backend: Backend,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """With a plan: check it fits the call. Without: check the metadata values now."""
    if plan is not None:
        plan.check_call(backend, k_cache, block_table=block_table, seq_lens=seq_lens)
        return
    check_block_table_values(block_table, seq_lens, k_cache.shape[1], k_cache.shape[0])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """One query token per sequence attends to all of its cached tokens.

    q [B, Hq, D]; k_cache, v_cache [P, page_size, Hkv, D]; block_table [B, max_pages] int32;
    seq_lens [B] int32 (tokens in cache, the current token's K/V already stored).
    Query head h uses KV head h // (Hq // Hkv). A sequence of length 0 gets zeros.
    ``plan``: the step's ``plan_attention`` for these block_table and seq_lens tensors.
    Returns [B, Hq, D] in q's dtype.
    """
    _check_attention_inputs(q, k_cache, v_cache, block_table, seq_lens, scale)
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences but seq_lens has {seq_lens.shape[0]}")
    chosen = resolve_backend(backend, q)
    _check_or_plan(plan, chosen, k_cache, block_table, seq_lens)
    if chosen == "torch":
        reads = plan.decode_reads if plan is not None else None
        return torch_attention.paged_decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, float(scale), reads
        )
    from . import triton_attention

    check_same_dtype(q=q, k_cache=k_cache)  # Triton reads the cache in the activations' dtype
    return triton_attention.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, float(scale)
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """A chunk of new tokens per sequence attends causally to its cached prefix and itself.

    q [T, Hq, D]: the new tokens of all sequences, concatenated; cu_seqlens_q [B+1] int32
    (sequence b's new tokens are q[cu[b]:cu[b+1]]); seq_lens [B] int32: total tokens per
    sequence, new ones included and already stored. New token i of a sequence with n new
    tokens sits at position seq_len - n + i and sees positions 0..seq_len - n + i.
    ``plan``: the step's ``plan_attention`` for these metadata tensors.
    Returns [T, Hq, D] in q's dtype.
    """
    _check_attention_inputs(q, k_cache, v_cache, block_table, seq_lens, scale)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    check_same_device(q=q, cu_seqlens_q=cu_seqlens_q)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q must have B+1 = {seq_lens.shape[0] + 1} entries, "
            f"got {cu_seqlens_q.shape[0]}"
        )
    chosen = resolve_backend(backend, q)
    _check_or_plan(plan, chosen, k_cache, block_table, seq_lens)
    if plan is not None:
        plan.check_call(chosen, k_cache, cu_seqlens_q=cu_seqlens_q)
        if plan.slot_mapping.shape[0] != q.shape[0]:
            planned = plan.slot_mapping.shape[0]
            raise ValueError(f"plan built for {planned} tokens, q has {q.shape[0]}")
    else:
        check_cu_seqlens_values(cu_seqlens_q, seq_lens, q.shape[0])
    if chosen == "torch":
        return torch_attention.paged_prefill_attention(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, float(scale)
        )
    from . import triton_attention

    check_same_dtype(q=q, k_cache=k_cache)
    longest = plan.max_new_tokens if plan is not None else None
    return triton_attention.paged_prefill_attention(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, float(scale), longest
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
    plan: AttentionPlan | None = None,
) -> None:
    """Write k, v [T, Hkv, D] into the caches in place at slot_mapping [T] (int32 or int64).

    slot = page * page_size + offset; a negative slot means "skip this token".
    ``plan``: the step's ``plan_attention`` for this slot_mapping tensor.
    """
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    num_pages, page_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    check_same_device(k=k, v=v, k_cache=k_cache, slot_mapping=slot_mapping)
    check_same_dtype(k=k, v=v)
    check_kv_storage("k", k, k_cache)
    check_last_dim_contiguous(k=k, v=v)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
    chosen = resolve_backend(backend, k)
    if plan is not None:
        plan.check_call(chosen, k_cache, slot_mapping=slot_mapping)
    else:
        check_slots_fit(slot_mapping, num_pages * page_size)
    if chosen == "torch":
        kept = plan.kept_slots if plan is not None else None
        torch_ops.store_kv(k, v, k_cache, v_cache, slot_mapping, kept)
        return
    from . import triton_ops

    check_same_dtype(k=k, k_cache=k_cache)
    triton_ops.store_kv(k, v, k_cache, v_cache, slot_mapping)
