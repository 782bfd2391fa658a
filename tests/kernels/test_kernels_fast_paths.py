"""The CPU torch fast paths against kernels.naive: fused-QKV rotary, consecutive-page decode
reads, and the per-step memo of ``kernels.checks.step_scope``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch

import kernels
from kernels import checks, naive, torch_attention, torch_ops

from .kernels_cases import ATTENTION_TOL, ROTARY_TOL, STORE_TOL, assert_close, make_paged_batch

THETA = 10000.0
PAGE_SIZE = 16
NUM_KV_HEADS = 2
GROUP = 3  # query heads per KV head
HEAD_DIM = 32
LAYOUTS = ["interleaved", "half"]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- 1. rotary on q and k as neighbouring views of one fused QKV row ---------------------------


def fused_qkv_views(
    tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] and its q [T, Hq, D], k [T, Hkv, D] slices, as engine/model.py."""
    qkv = randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=tokens)
    kv_start, v_start = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    q = qkv[:, :kv_start].view(tokens, num_q_heads, head_dim)
    k = qkv[:, kv_start:v_start].view(tokens, num_kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("start", [0, 5, 1000])
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_on_fused_qkv_views_equals_contiguous_clones(
    layout: str, tokens: int, start: int, dtype: torch.dtype
) -> None:
    qkv, q, k = fused_qkv_views(tokens, NUM_KV_HEADS * GROUP, NUM_KV_HEADS, HEAD_DIM, dtype)
    # the case really is the fused one: k's heads follow q's in one storage
    assert torch_ops._adjacent_heads(q, k) is not None
    positions = torch.arange(start, start + tokens)
    cache = kernels.rotary_cache(start + tokens + 3, HEAD_DIM, THETA)
    before = qkv.clone()

    q_rot, k_rot = kernels.rotary(q, k, positions, cache, layout=layout, backend="torch")
    want_q, want_k = kernels.rotary(
        q.clone(), k.clone(), positions, cache, layout=layout, backend="torch"
    )

    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert q_rot.dtype == dtype and k_rot.dtype == dtype
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    ref_q, ref_k = naive.rotary(q, k, positions, HEAD_DIM, THETA, layout)
    assert_close(q_rot, ref_q, ROTARY_TOL[dtype])
    assert_close(k_rot, ref_k, ROTARY_TOL[dtype])
    # "out of place": the fused tensor is untouched, and the outputs do not alias it
    assert torch.equal(qkv, before)
    q_rot.fill_(7.0)
    k_rot.fill_(7.0)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_on_views_that_are_not_neighbours_matches_naive(layout: str) -> None:
    """q and k from one fused row with a gap (k taken from the V part): not fused, still right."""
    qkv, q, _ = fused_qkv_views(7, 4, 2, HEAD_DIM, torch.float32)
    k_far = qkv[:, 6 * HEAD_DIM :].view(7, 2, HEAD_DIM)  # V's heads, not next to q
    assert torch_ops._adjacent_heads(q, k_far) is None
    positions = torch.tensor([3, 9, 4, 100, 0, 17, 17])  # not sorted, repeated
    cache = kernels.rotary_cache(128, HEAD_DIM, THETA)
    before = qkv.clone()
    q_rot, k_rot = kernels.rotary(q, k_far, positions, cache, layout=layout, backend="torch")
    ref_q, ref_k = naive.rotary(q, k_far, positions, HEAD_DIM, THETA, layout)
    assert_close(q_rot, ref_q, ROTARY_TOL[torch.float32])
    assert_close(k_rot, ref_k, ROTARY_TOL[torch.float32])
    assert torch.equal(qkv, before)


# --- 2. decode over consecutive pages: a view of the cache, no gather ---------------------------


def paged_case(
    lens: list[int], pages: list[list[int]], num_pages: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], caches [P, page, Hkv, D] (random junk elsewhere), block_table, seq_lens
    with sequence b's tokens in pages[b] (a page list may be consecutive or scattered)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    width = max(1, *(len(p) for p in pages)) + 1  # one spare column of -1 padding
    block_table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, (length, row) in enumerate(zip(lens, pages, strict=True)):
        assert len(row) == -(-length // PAGE_SIZE)
        block_table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    q = torch.randn(len(lens), NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, block_table, torch.tensor(lens, dtype=torch.int32)


def consecutive(first: int, length: int) -> list[int]:
    return list(range(first, first + -(-length // PAGE_SIZE)))


DECODE_VIEW_CASES = {  # name: (lengths, page lists, num_pages)
    "one-mid-page": ([37], [consecutive(2, 37)], 6),
    "one-on-boundary": ([48], [consecutive(0, 48)], 4),
    "one-single-page": ([16], [consecutive(5, 16)], 6),
    "batch-mid-page": ([70, 5], [consecutive(1, 70), consecutive(7, 5)], 9),
    "batch-on-boundary": ([64, 16], [consecutive(3, 64), consecutive(0, 16)], 8),
    "batch-with-empty": ([70, 0, 9], [consecutive(2, 70), [], consecutive(0, 9)], 8),
    "mixed-view-and-gather": ([100, 33, 5], [consecutive(4, 100), [13, 1, 15], [3]], 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(DECODE_VIEW_CASES))
def test_decode_consecutive_pages_matches_naive(case: str, dtype: torch.dtype) -> None:
    lens, pages, num_pages = DECODE_VIEW_CASES[case]
    q, k_cache, v_cache, block_table, seq_lens = paged_case(lens, pages, num_pages, dtype)
    plan = torch_attention._decode_plan(block_table, seq_lens, PAGE_SIZE, num_pages)
    # the case reads sequence by sequence, each as a view exactly when its pages are consecutive
    assert plan.pages is None
    for seq in plan.seqs:
        is_run = pages[seq.index] == consecutive(pages[seq.index][0], lens[seq.index])
        assert (seq.first_page >= 0) == is_run
    k_before, v_before = k_cache.clone(), v_cache.clone()
    scale = HEAD_DIM**-0.5

    out = kernels.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, backend="torch"
    )

    assert out.dtype == dtype and out.shape == q.shape
    want = naive.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)
    assert_close(out, want, ATTENTION_TOL[dtype])
    # reading a view must not write through it
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    for b, length in enumerate(lens):
        if length == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_view_reads_only_the_sequence_length(dtype: torch.dtype) -> None:
    """Tokens past seq_len in the last consecutive page are junk and must not be read."""
    q, k_cache, v_cache, block_table, seq_lens = paged_case([20], [[0, 1]], 2, dtype)
    scale = HEAD_DIM**-0.5
    before = kernels.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, backend="torch"
    )
    k_cache[1, 4:] = 1e3  # tokens 20..31 of page 1: beyond the sequence
    v_cache[1, 4:] = -1e3
    after = kernels.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, backend="torch"
    )
    assert torch.equal(before, after)


# --- 3. step_scope: the per-step memo -----------------------------------------------------------


DecodeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]


def decode_call(args: DecodeArgs) -> torch.Tensor:
    """The torch decode on (q, k_cache, v_cache, block_table, seq_lens, scale)."""
    q, k_cache, v_cache, block_table, seq_lens, scale = args
    return kernels.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, backend="torch"
    )


def scoped_twice(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """fn() inside a scope, twice (the second call reads the memo), and inside a nested one."""
    with checks.step_scope():
        first = fn()
        again = fn()
        with checks.step_scope():
            nested = fn()
    assert torch.equal(first, again)
    return first, nested


DECODE_LENS = {"padded": [40, 33, 48], "per-sequence": [70, 5, 0]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", list(DECODE_LENS))
def test_decode_in_scope_equals_outside(kind: str, dtype: torch.dtype) -> None:
    batch = make_paged_batch(DECODE_LENS[kind], [1] * 3, 6, 2, HEAD_DIM, PAGE_SIZE, dtype, seed=3)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.scale)
    plan = torch_attention._decode_plan(
        batch.block_table, batch.seq_lens, PAGE_SIZE, batch.k_cache.shape[0]
    )
    assert (plan.pages is not None) == (kind == "padded")
    outside = decode_call(args)
    scoped, nested = scoped_twice(lambda: decode_call(args))
    assert torch.equal(scoped, outside) and torch.equal(nested, outside)
    want = naive.paged_decode_attention(*args)
    assert_close(outside, want, ATTENTION_TOL[dtype])


def test_decode_scope_reuses_plan_across_layers_with_other_caches() -> None:
    """One step, several layers: the same metadata tensors, a different q and cache per layer."""
    base = make_paged_batch([70, 5, 33], [1] * 3, 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    shape = tuple(base.k_cache.shape)
    layers = [(base.q, base.k_cache, base.v_cache)] + [
        (randn(*base.q.shape, seed=s), randn(*shape, seed=s + 1), randn(*shape, seed=s + 2))
        for s in (10, 20)
    ]
    meta = (base.block_table, base.seq_lens, base.scale)
    with checks.step_scope():
        scoped = [decode_call((*layer, *meta)) for layer in layers]
    for layer, out in zip(layers, scoped, strict=True):
        assert_close(out, naive.paged_decode_attention(*layer, *meta), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_prefill_in_scope_equals_outside(dtype: torch.dtype) -> None:
    batch = make_paged_batch([20, 40, 9], [0, 5, 9], 6, 2, HEAD_DIM, PAGE_SIZE, dtype, seed=4)
    args = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.scale,
    )

    def call() -> torch.Tensor:
        return kernels.paged_prefill_attention(*args, backend="torch")

    outside = call()
    scoped, nested = scoped_twice(call)
    assert torch.equal(scoped, outside) and torch.equal(nested, outside)
    assert_close(outside, naive.paged_prefill_attention(*args), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_store_kv_in_scope_equals_outside(dtype: torch.dtype) -> None:
    """Two layers store with one slot tensor: in a scope the second reuses the slots' plan."""
    shape = (5, 8, 2, HEAD_DIM)
    slots = torch.tensor([3, -1, 17, 39, -1, 8], dtype=torch.int32)
    layer_kv = [
        (randn(6, 2, HEAD_DIM, dtype=dtype, seed=s), randn(6, 2, HEAD_DIM, dtype=dtype, seed=s + 1))
        for s in (0, 2)
    ]

    def fresh_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (randn(*shape, dtype=dtype, seed=9), randn(*shape, dtype=dtype, seed=8))
            for _ in layer_kv
        ]

    want, outside, scoped = fresh_caches(), fresh_caches(), fresh_caches()
    for (k, v), (kc, vc) in zip(layer_kv, want, strict=True):
        naive.store_kv(k, v, kc, vc, slots)
    for (k, v), (kc, vc) in zip(layer_kv, outside, strict=True):
        kernels.store_kv(k, v, kc, vc, slots, backend="torch")
    with checks.step_scope():
        for (k, v), (kc, vc) in zip(layer_kv, scoped, strict=True):
            kernels.store_kv(k, v, kc, vc, slots, backend="torch")
    for (wk, wv), (ok, ov), (sk, sv) in zip(want, outside, scoped, strict=True):
        assert_close(ok, wk, STORE_TOL)
        assert_close(ov, wv, STORE_TOL)
        assert torch.equal(sk, ok) and torch.equal(sv, ov)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_in_scope_equals_outside(layout: str) -> None:
    cache = kernels.rotary_cache(64, HEAD_DIM, THETA)
    positions = torch.arange(9, 16)
    fused = fused_qkv_views(7, 6, 2, HEAD_DIM, torch.float32)[1:]
    separate = (randn(7, 6, HEAD_DIM, seed=5), randn(7, 2, HEAD_DIM, seed=6))
    for q, k in (fused, separate):

        def call(q: torch.Tensor = q, k: torch.Tensor = k) -> torch.Tensor:
            return torch.cat(kernels.rotary(q, k, positions, cache, layout, backend="torch"), 1)

        outside = call()
        scoped, nested = scoped_twice(call)
        assert torch.equal(scoped, outside) and torch.equal(nested, outside)
        ref_q, ref_k = naive.rotary(q, k, positions, HEAD_DIM, THETA, layout)
        assert_close(outside, torch.cat([ref_q, ref_k], 1), ROTARY_TOL[torch.float32])


def test_scope_memo_is_per_scope_nested_and_restored() -> None:
    t = torch.tensor([1, 2, 3])
    calls: list[int] = []

    def compute() -> int:
        calls.append(1)
        return len(calls)

    assert checks.memoized("tag", (t,), compute) == 1  # no scope: always computed
    assert checks.memoized("tag", (t,), compute) == 2
    with checks.step_scope() as outer:
        assert checks.memoized("tag", (t,), compute) == 3
        assert checks.memoized("tag", (t,), compute) == 3  # memo hit
        assert checks.memoized("other", (t,), compute) == 4  # the tag is part of the key
        with checks.step_scope() as inner:
            assert inner is not outer
            assert checks.memoized("tag", (t,), compute) == 5  # inner starts empty
            assert checks.memoized("tag", (t,), compute) == 5
        assert checks.memoized("tag", (t,), compute) == 3  # outer memo restored
    assert checks.memoized("tag", (t,), compute) == 6  # scope closed: computed again


def test_scope_memo_never_confuses_a_new_tensor_with_a_freed_one() -> None:
    """The memo keys by id(); it must hold its tensors so a new tensor cannot reuse an id."""
    with checks.step_scope():
        for i in range(50):
            t = torch.tensor([i])
            assert checks.memoized("value", (t,), lambda t=t: int(t.item())) == i
            del t


def test_new_scope_sees_metadata_changed_between_steps() -> None:
    """The engine may refill its metadata tensors between steps: each step's scope re-reads."""
    batch = make_paged_batch([40, 33, 48], [1] * 3, 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    seq_lens = batch.seq_lens.clone()
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, seq_lens, batch.scale)
    for lens in ([40, 33, 48], [41, 34, 48], [3, 33, 20]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        with checks.step_scope():
            out = decode_call(args)
        assert_close(out, naive.paged_decode_attention(*args), ATTENTION_TOL[torch.float32])
    seq_lens.fill_(1000)
    with checks.step_scope(), pytest.raises(ValueError, match="exceeds block_table capacity"):
        decode_call(args)


def in_and_out_of_scope(fn: Callable[[], object], error: type[Exception], match: str) -> None:
    """fn raises the same clear error outside a scope, inside one (twice), and nested."""
    with pytest.raises(error, match=match):
        fn()
    with checks.step_scope():
        for _ in range(2):  # a failed check must not be memoized as passed
            with pytest.raises(error, match=match):
                fn()
        with checks.step_scope(), pytest.raises(error, match=match):
            fn()


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_seq_lens_beyond_block_table_raises_in_scope(kind: str) -> None:
    batch = make_paged_batch([20, 9], [4, 9], 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    good_lens = batch.seq_lens
    bad_lens = torch.tensor([20, 2 * PAGE_SIZE + 1], dtype=torch.int32)  # 2 pages hold 32

    def call(seq_lens: torch.Tensor) -> torch.Tensor:
        if kind == "decode":
            return kernels.paged_decode_attention(
                batch.q[:2],
                batch.k_cache,
                batch.v_cache,
                batch.block_table,
                seq_lens,
                batch.scale,
                backend="torch",
            )
        return kernels.paged_prefill_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_table,
            batch.cu_seqlens_q,
            seq_lens,
            batch.scale,
            backend="torch",
        )

    in_and_out_of_scope(lambda: call(bad_lens), ValueError, "exceeds block_table capacity")
    with checks.step_scope():  # a good call first does not let a bad one through
        call(good_lens)
        with pytest.raises(ValueError, match="exceeds block_table capacity"):
            call(bad_lens)


def test_slot_beyond_cache_raises_in_scope() -> None:
    k = randn(3, 1, HEAD_DIM)
    big = (randn(4, 8, 1, HEAD_DIM), randn(4, 8, 1, HEAD_DIM))  # 32 slots
    small = (randn(2, 8, 1, HEAD_DIM), randn(2, 8, 1, HEAD_DIM))  # 16 slots
    slots = torch.tensor([0, 1, 16])
    in_and_out_of_scope(lambda: kernels.store_kv(k, k, *small, slots), ValueError, "cache capacity")
    with checks.step_scope():  # slots that fit one cache are still checked against a smaller one
        kernels.store_kv(k, k, *big, slots)
        assert torch.equal(big[0][2, 0], k[2])
        with pytest.raises(ValueError, match="cache capacity"):
            kernels.store_kv(k, k, *small, slots)


def test_position_beyond_rotary_cache_raises_in_scope() -> None:
    q, k = randn(3, 2, HEAD_DIM), randn(3, 1, HEAD_DIM)
    positions = torch.tensor([0, 5, 40])
    in_and_out_of_scope(
        lambda: kernels.rotary(q, k, positions, kernels.rotary_cache(16, HEAD_DIM, THETA)),
        ValueError,
        "positions must lie in",
    )
    with checks.step_scope():  # positions checked against each call's cache, not the first one
        kernels.rotary(q, k, positions, kernels.rotary_cache(64, HEAD_DIM, THETA))
        with pytest.raises(ValueError, match="positions must lie in"):
            kernels.rotary(q, k, positions, kernels.rotary_cache(16, HEAD_DIM, THETA))


@pytest.mark.parametrize(
    "lens", [pytest.param([20, 20], id="padded"), [60, 5]], ids=str
)
@pytest.mark.parametrize("scoped", [False, True])
def test_decode_page_id_beyond_cache_raises(lens: list[int], scoped: bool) -> None:
    """A sequence's own page id past the cache is bad input on every decode path (the padded
    path once read it silently as the last page)."""
    batch = make_paged_batch(lens, [1, 1], 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    num_pages = batch.k_cache.shape[0]
    block_table = batch.block_table.clone()
    block_table[0, 1] = num_pages + 5  # token 16 of sequence 0 lives in this page
    args = (batch.q, batch.k_cache, batch.v_cache, block_table, batch.seq_lens, batch.scale)
    padded = torch_attention._decode_plan(block_table, batch.seq_lens, PAGE_SIZE, num_pages)
    assert (padded.pages is not None) == (lens == [20, 20])
    with pytest.raises(IndexError):  # the reference cannot read it either
        naive.paged_decode_attention(*args)
    with checks.step_scope() if scoped else nullcontext(), pytest.raises(
        ValueError, match="outside the cache"
    ):
        decode_call(args)
