"""Input checks shared by the public ops: clear errors before any kernel launch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32,)
ROTARY_LAYOUTS = ("interleaved", "half")


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with ``ndim`` dimensions and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    return t


def check_same_device(**tensors: torch.Tensor) -> None:
    """Check that all named tensors live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n}={d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Check that all named tensors have one dtype."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise TypeError(f"tensors must share one dtype, got {listing}")


def kv_storage_ok(activations: torch.dtype, cache: torch.Tensor) -> bool:
    """Whether a KV cache may hold these activations: in their own dtype, or float16 for
    float32 activations on CPU (the torch path converts on store and after each read)."""
    if activations == cache.dtype:
        return True
    return activations == torch.float32 and cache.dtype == torch.float16 and not cache.is_cuda


def check_kv_storage(name: str, t: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Check that ``k_cache`` may hold ``t``'s dtype (see ``kv_storage_ok``)."""
    if not kv_storage_ok(t.dtype, k_cache):
        raise TypeError(
            f"{name} is {t.dtype}, the KV cache {k_cache.dtype}: a cache holds its activations' "
            "dtype (or float16 for float32 activations on CPU)"
        )


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Check that the last dimension of each tensor has stride 1 (kernels load rows)."""
    for name, t in tensors.items():
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}"
            )


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check the paged KV cache pair; return (num_pages, page_size, num_kv_heads, head_dim)."""
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}"
        )
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            "k_cache and v_cache must be contiguous [num_pages, page_size, num_kv_heads, head_dim]"
        )
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if page_size < 8 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 8, got {page_size}")
    return num_pages, page_size, num_kv_heads, head_dim


def check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    """Check GQA head counts; return the group size (query heads per KV head)."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def check_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, batch: int) -> None:
    """Check block_table [B, max_pages] int32 and seq_lens [B] int32."""
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    if block_table.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"batch size mismatch: expected {batch} sequences, got block_table rows "
            f"{block_table.shape[0]} and seq_lens {seq_lens.shape[0]}"
        )
    if block_table.numel() > 0 and block_table.stride(-1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")


def check_seq_lens_fit(seq_lens: torch.Tensor, max_pages: int, page_size: int) -> None:
    """On CPU, check every length lies in [0, what the block table can address]."""
    if seq_lens.is_cuda or seq_lens.numel() == 0:
        return
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {lo}")
    if hi > max_pages * page_size:
        raise ValueError(
            f"seq_lens max {hi} exceeds block_table capacity {max_pages} pages x {page_size}"
        )


def check_pages_in_cache(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_pages: int
) -> None:
    """On CPU, check that every page a sequence uses (its first ceil(len / page_size) entries) is
    a page of the cache; the entries past that are padding and may hold anything."""
    if block_table.is_cuda or seq_lens.numel() == 0:
        return
    used = (seq_lens.long() + page_size - 1) // page_size  # [B] pages each sequence reads
    width = int(used.max())
    if width <= 0:
        return
    in_use = torch.arange(width)[None, :] < used[:, None]  # [B, width]
    ids = block_table[:, :width][in_use]
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_pages:
        bad = lo if lo < 0 else hi
        raise ValueError(f"block_table uses page {bad}, outside the cache's {num_pages} pages")


def check_block_table_values(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_pages: int
) -> None:
    """Shapes of block_table [B, max_pages] / seq_lens [B]; on CPU also their values."""
    check_block_table(block_table, seq_lens, seq_lens.shape[0] if seq_lens.dim() == 1 else -1)
    check_seq_lens_fit(seq_lens, block_table.shape[1], page_size)
    check_pages_in_cache(block_table, seq_lens, page_size, num_pages)


def check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, total: int) -> None:
    """On CPU, check cu_seqlens_q is a non-decreasing split of T=total tokens within seq_lens."""
    if cu_seqlens_q.is_cuda:
        return
    bounds = cu_seqlens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at T={total}, got {bounds}")
    n_new = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
    for b, (n, length) in enumerate(zip(n_new, seq_lens.tolist(), strict=True)):
        if n < 0 or n > length:
            raise ValueError(
                f"sequence {b}: {n} new tokens but seq_len {length} (need 0 <= new <= seq_len)"
            )


def check_slots_fit(slot_mapping: torch.Tensor, capacity: int) -> None:
    """On CPU, check every slot is below the cache capacity (negative slots are skips)."""
    if slot_mapping.is_cuda or slot_mapping.numel() == 0:
        return
    top = int(slot_mapping.max())
    if top >= capacity:
        raise ValueError(f"slot {top} >= cache capacity {capacity} (num_pages * page_size)")


def check_positions_fit(positions: torch.Tensor, max_positions: int) -> None:
    """On CPU, check every position indexes a row of a rotary table of ``max_positions`` rows."""
    if positions.is_cuda or positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= max_positions:
        raise ValueError(f"positions must lie in [0, {max_positions}), got [{lo}, {hi}]")
