"""Triton paged attention under TRITON_INTERPRET=1 against the naive reference.

Shapes stay small (the interpreter runs each program in Python): one KV head for the sweeps,
two where head indexing matters.
"""

from __future__ import annotations

import os

import pytest
import torch

import paged_kernels
from paged_kernels import naive
from paged_kernels.backend import triton_interpret_enabled

from .kernels_cases import ATTENTION_TOL, PagedBatch, assert_close, make_paged_batch

pytest.importorskip("triton")

DECODE_LENS = [[1], [15], [63], [300], [1, 15, 63, 300]]
PREFILL_CASES = [  # (seq_lens, new tokens per sequence)
    ([1], [1]),
    ([15], [15]),
    ([63], [20]),
    ([300], [45]),
    ([1, 15, 63, 300], [1, 7, 63, 30]),
    ([20, 40], [0, 5]),
]
GROUPS = [1, 3, 8]
PAGE_SIZE = 16
LAYOUT_CASES = [  # (num_kv_heads, group, head_dim, dtype) on the ragged batch
    (1, 3, 128, torch.float32),
    (1, 3, 64, torch.float16),
    (1, 3, 128, torch.float16),
    (2, 3, 64, torch.float32),
]


def batch_for(
    lens: list[int], n_new: list[int], num_kv_heads: int, group: int, head_dim: int,
    dtype: torch.dtype,
) -> PagedBatch:
    return make_paged_batch(lens, n_new, num_kv_heads * group, num_kv_heads, head_dim,
                            PAGE_SIZE, dtype, seed=len(lens) + group)


def decode(batch: PagedBatch, fn=paged_kernels.paged_decode_attention, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return fn(batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
              batch.scale, **kw)


def prefill(batch: PagedBatch, fn=paged_kernels.paged_prefill_attention, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return fn(batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.cu_seqlens_q,
              batch.seq_lens, batch.scale, **kw)


@pytest.mark.skipif(
    os.environ.get("PREFIXGATE_KERNEL_DEVICE", "cpu") != "cpu", reason="kernels run on a GPU"
)
def test_interpreter_is_on() -> None:
    assert triton_interpret_enabled()


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("lens", DECODE_LENS, ids=str)
def test_triton_decode_matches_naive(lens: list[int], group: int) -> None:
    batch = batch_for(lens, [1] * len(lens), 1, group, 64, torch.float32)
    out = decode(batch, backend="triton")
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    assert_close(out, decode(batch, naive.paged_decode_attention), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("config", LAYOUT_CASES, ids=str)
def test_triton_decode_head_dims_and_dtypes(config: tuple[int, int, int, torch.dtype]) -> None:
    num_kv_heads, group, head_dim, dtype = config
    lens = DECODE_LENS[-1]
    batch = batch_for(lens, [1] * len(lens), num_kv_heads, group, head_dim, dtype)
    out = decode(batch, backend="triton")
    assert out.dtype == dtype
    assert_close(out, decode(batch, naive.paged_decode_attention), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_triton_decode_split_k_merge(num_splits: int) -> None:
    """Any split count (some splits empty for the short sequences) gives the same answer."""
    from paged_kernels import triton_attention

    batch = batch_for([300, 2, 130], [1, 1, 1], 2, 3, 64, torch.float32)
    out = decode(batch, triton_attention.paged_decode_attention, num_splits=num_splits)
    assert_close(out, decode(batch, naive.paged_decode_attention), ATTENTION_TOL[torch.float32])


def test_triton_decode_empty_sequence_gives_zeros() -> None:
    batch = batch_for([0, 33], [1, 1], 1, 3, 64, torch.float32)
    out = decode(batch, backend="triton")
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out[1:], decode(batch, naive.paged_decode_attention)[1:],
                 ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_triton_prefill_matches_naive(case: tuple[list[int], list[int]], group: int) -> None:
    lens, n_new = case
    batch = batch_for(lens, n_new, 1, group, 64, torch.float32)
    out = prefill(batch, backend="triton")
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    assert_close(out, prefill(batch, naive.paged_prefill_attention), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("config", LAYOUT_CASES, ids=str)
def test_triton_prefill_head_dims_and_dtypes(config: tuple[int, int, int, torch.dtype]) -> None:
    num_kv_heads, group, head_dim, dtype = config
    lens, n_new = PREFILL_CASES[4]
    batch = batch_for(lens, n_new, num_kv_heads, group, head_dim, dtype)
    out = prefill(batch, backend="triton")
    assert out.dtype == dtype
    assert_close(out, prefill(batch, naive.paged_prefill_attention), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("page_size", [8, 64])
def test_triton_attention_other_page_sizes(page_size: int) -> None:
    lens, n_new = [1, 40, 130], [1, 9, 17]
    decode_batch = make_paged_batch(lens, [1, 1, 1], 3, 1, 64, page_size, torch.float32, seed=3)
    assert_close(decode(decode_batch, backend="triton"),
                 decode(decode_batch, naive.paged_decode_attention), ATTENTION_TOL[torch.float32])
    batch = make_paged_batch(lens, n_new, 3, 1, 64, page_size, torch.float32, seed=4)
    assert_close(prefill(batch, backend="triton"), prefill(batch, naive.paged_prefill_attention),
                 ATTENTION_TOL[torch.float32])
