"""A float16 KV cache of float32 activations on the torch path (`kv_cache_dtype="float16"`).

Reference: dense attention (float64) over the K/V the cache holds, i.e. rounded to float16. The
paged reads (views, gathers, padded batches, few-row prefill, SDPA prefill) must give float32
outputs within float32 tolerance of it; the store rounds to nearest like `.to(torch.float16)`.
The Triton path reads a cache of the activations' own dtype and refuses a mixed one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import paged_kernels

from .kernels_cases import ATTENTION_TOL, PagedBatch, assert_close, make_paged_batch
from .test_kernels_torch_attention import (
    DECODE_LENS,
    NUM_KV_HEADS,
    PAGE_SIZE,
    PREFILL_CASES,
    dense_expected,
    run_decode,
    run_prefill,
)


def _half_cache(batch: PagedBatch) -> PagedBatch:
    """The batch with float16 caches; the dense reference holds what they hold."""
    return replace(
        batch, k_cache=batch.k_cache.half(), v_cache=batch.v_cache.half(),
        dense_k=[k.half().float() for k in batch.dense_k],
        dense_v=[v.half().float() for v in batch.dense_v],
    )  # fmt: skip


@pytest.mark.parametrize("lens", [*DECODE_LENS, [40, 45, 33], [48, 48, 48]], ids=str)
def test_decode_over_a_half_cache_matches_dense_attention(lens: list[int]) -> None:
    batch = _half_cache(make_paged_batch(lens, [1] * len(lens), NUM_KV_HEADS * 3, NUM_KV_HEADS,
                                         64, PAGE_SIZE, torch.float32))
    out = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
    assert out.dtype == torch.float32
    assert_close(out, dense_expected(batch), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_over_a_half_cache_matches_dense_attention(
    case: tuple[list[int], list[int]]
) -> None:
    lens, n_new = case
    batch = _half_cache(make_paged_batch(lens, n_new, NUM_KV_HEADS * 3, NUM_KV_HEADS, 64,
                                         PAGE_SIZE, torch.float32))
    out = run_prefill(paged_kernels.paged_prefill_attention, batch, backend="torch")
    assert out.dtype == torch.float32
    assert_close(out, dense_expected(batch), ATTENTION_TOL[torch.float32])


def test_consecutive_pages_of_a_half_cache_read_as_views() -> None:
    """One sequence in pages 0.. in order: the view path (no gather) converts too."""
    batch = _half_cache(make_paged_batch([40], [1], NUM_KV_HEADS * 3, NUM_KV_HEADS, 64,
                                         PAGE_SIZE, torch.float32))
    ordered = torch.arange(batch.block_table.shape[1], dtype=torch.int32)[None]
    k, v = batch.k_cache.clone(), batch.v_cache.clone()
    for i, page in enumerate(batch.block_table[0].tolist()):
        k[i], v[i] = batch.k_cache[page], batch.v_cache[page]
    batch = replace(batch, block_table=ordered, k_cache=k, v_cache=v)
    out = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
    assert_close(out, dense_expected(batch), ATTENTION_TOL[torch.float32])


def test_store_rounds_float32_rows_into_a_half_cache() -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(4, PAGE_SIZE, NUM_KV_HEADS, 64, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, NUM_KV_HEADS, 64, generator=gen) * 3
    v = torch.randn(5, NUM_KV_HEADS, 64, generator=gen)
    slots = torch.tensor([17, 3, -1, 40, 63])
    paged_kernels.store_kv(k, v, k_cache, v_cache, slots, backend="torch")
    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, 64), v_cache.view(-1, NUM_KV_HEADS, 64)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[row].half())
            assert torch.equal(flat_v[slot], v[row].half())
    assert int((flat_k != 0).any(-1).any(-1).sum()) == 4  # the skipped row wrote nothing


def test_mixed_dtypes_are_refused_where_they_cannot_run() -> None:
    batch = make_paged_batch([20], [1], NUM_KV_HEADS * 3, NUM_KV_HEADS, 64, PAGE_SIZE,
                             torch.float32)
    half = _half_cache(batch)
    with pytest.raises(TypeError, match="KV cache"):  # float16 activations, float32 cache
        run_decode(paged_kernels.paged_decode_attention, replace(batch, q=batch.q.half()),
                   backend="torch")
    with pytest.raises(TypeError, match="KV cache"):  # bfloat16 cache of float32 activations
        run_decode(paged_kernels.paged_decode_attention,
                   replace(half, k_cache=half.k_cache.bfloat16(), v_cache=half.v_cache.bfloat16()),
                   backend="torch")
    # the Triton kernels read the cache in the activations' dtype: refused before any launch
    with pytest.raises(TypeError, match="share one dtype"):
        run_decode(paged_kernels.paged_decode_attention, half, backend="triton")
    with pytest.raises(TypeError, match="share one dtype"):
        run_prefill(paged_kernels.paged_prefill_attention, half, backend="triton")
    k = torch.zeros(1, NUM_KV_HEADS, 64)
    with pytest.raises(TypeError, match="share one dtype"):
        paged_kernels.store_kv(k, k, half.k_cache, half.v_cache, torch.tensor([0]),
                               backend="triton")
