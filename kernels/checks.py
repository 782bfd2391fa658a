"""Input checks shared by the public ops: clear errors before any kernel launch."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32,)


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
    """On CPU, check every length is within what the block table can address (once per scope)."""
    if seq_lens.is_cuda or seq_lens.numel() == 0:
        return
    memoized(
        ("seq_lens_fit", max_pages, page_size),
        (seq_lens,),
        lambda: _check_seq_lens_values(seq_lens, max_pages, page_size),
    )


def _check_seq_lens_values(seq_lens: torch.Tensor, max_pages: int, page_size: int) -> None:
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


# --- per-step memo -----------------------------------------------------------------------------
# A decode step runs the same ops once per layer over the same metadata tensors (block table,
# lengths, slots, positions). Inside ``step_scope`` the value checks and the index plans derived
# from those tensors are computed once per tensor object and reused by every later layer.

_scope = threading.local()
_T = TypeVar("_T")


class StepMemo:
    """Values derived from metadata tensors, keyed by a tag and the tensors' identities.

    Holding the tensors keeps their ids from being reused while the memo lives.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[Hashable, ...], tuple[tuple[torch.Tensor, ...], object]] = {}

    def get(
        self, tag: Hashable, tensors: tuple[torch.Tensor, ...], compute: Callable[[], _T]
    ) -> _T:
        key = (tag, *(id(t) for t in tensors))
        hit = self._entries.get(key)
        if hit is not None:
            return hit[1]  # type: ignore[return-value]
        value = compute()
        self._entries[key] = (tensors, value)
        return value


@contextmanager
def step_scope() -> Iterator[StepMemo]:
    """Check and preprocess each metadata tensor once for the ops run inside this scope.

    The caller promises not to modify, inside the scope, any index tensor it passes to the ops
    (block tables, lengths, slots, positions, cu_seqlens): results derived from them are reused.
    Shape and dtype checks still run on every call. Scopes nest; the inner one starts empty.
    """
    previous = getattr(_scope, "memo", None)
    memo = StepMemo()
    _scope.memo = memo
    try:
        yield memo
    finally:
        _scope.memo = previous


def memoized(tag: Hashable, tensors: tuple[torch.Tensor, ...], compute: Callable[[], _T]) -> _T:
    """``compute()``, or inside ``step_scope`` its value from an earlier call with these tensors."""
    memo: StepMemo | None = getattr(_scope, "memo", None)
    if memo is None:
        return compute()
    return memo.get(tag, tensors, compute)
