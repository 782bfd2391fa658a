"""The CPU torch fast paths against paged_kernels.naive: fused-QKV rotary, consecutive-page decode
reads, and the explicit per-step plans of ``paged_kernels.plan_attention`` /
``paged_kernels.plan_rotary``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import paged_kernels
from paged_kernels import naive, torch_attention, torch_ops

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
    cache = paged_kernels.rotary_cache(start + tokens + 3, HEAD_DIM, THETA)
    before = qkv.clone()

    q_rot, k_rot = paged_kernels.rotary(q, k, positions, cache, layout=layout, backend="torch")
    want_q, want_k = paged_kernels.rotary(
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
    cache = paged_kernels.rotary_cache(128, HEAD_DIM, THETA)
    before = qkv.clone()
    q_rot, k_rot = paged_kernels.rotary(q, k_far, positions, cache, layout=layout, backend="torch")
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
    plan = torch_attention.decode_read_plan(block_table, seq_lens, PAGE_SIZE, num_pages)
    # the case reads sequence by sequence, each as a view exactly when its pages are consecutive
    assert plan.pages is None
    for seq in plan.seqs:
        is_run = pages[seq.row] == consecutive(pages[seq.row][0], lens[seq.row])
        assert (seq.first_page >= 0) == is_run
    k_before, v_before = k_cache.clone(), v_cache.clone()
    scale = HEAD_DIM**-0.5

    out = paged_kernels.paged_decode_attention(
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
    before = paged_kernels.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, backend="torch"
    )
    k_cache[1, 4:] = 1e3  # tokens 20..31 of page 1: beyond the sequence
    v_cache[1, 4:] = -1e3
    after = paged_kernels.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, backend="torch"
    )
    assert torch.equal(before, after)


# --- 3. explicit step plans -------------------------------------------------------------------


DecodeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]


def decode_call(args: DecodeArgs, plan: paged_kernels.AttentionPlan | None = None) -> torch.Tensor:
    """The torch decode on (q, k_cache, v_cache, block_table, seq_lens, scale)."""
    q, k_cache, v_cache, block_table, seq_lens, scale = args
    return paged_kernels.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, backend="torch", plan=plan
    )


def decode_plan(
    block_table: torch.Tensor, seq_lens: torch.Tensor, k_cache: torch.Tensor
) -> paged_kernels.AttentionPlan:
    """A decode step's plan: one new token per non-empty sequence, its slots skipped (-1)."""
    new = (seq_lens > 0).to(torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0, dtype=torch.int32)])
    return paged_kernels.plan_attention(
        block_table,
        seq_lens,
        cu,
        torch.full((int(new.sum()),), -1, dtype=torch.int64),
        k_cache,
        is_decode=True,
        backend="torch",
    )


DECODE_LENS = {"padded": [40, 33, 48], "per-sequence": [70, 5, 0]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", list(DECODE_LENS))
def test_decode_with_plan_equals_without(kind: str, dtype: torch.dtype) -> None:
    batch = make_paged_batch(DECODE_LENS[kind], [1] * 3, 6, 2, HEAD_DIM, PAGE_SIZE, dtype, seed=3)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.scale)
    plan = decode_plan(batch.block_table, batch.seq_lens, batch.k_cache)
    assert plan.decode_reads is not None
    # similar lengths are gathered padded in either dtype (a small batch on CPU float32 too)
    padded = kind == "padded"
    assert (plan.decode_reads.pages is not None) == padded
    outside = decode_call(args)
    first, again = decode_call(args, plan), decode_call(args, plan)
    assert torch.equal(first, outside) and torch.equal(again, outside)
    want = naive.paged_decode_attention(*args)
    assert_close(outside, want, ATTENTION_TOL[dtype])


def test_decode_plan_reused_across_layers_with_other_caches() -> None:
    """One step, several layers: the same metadata tensors, a different q and cache per layer."""
    base = make_paged_batch([70, 5, 33], [1] * 3, 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    shape = tuple(base.k_cache.shape)
    layers = [(base.q, base.k_cache, base.v_cache)] + [
        (randn(*base.q.shape, seed=s), randn(*shape, seed=s + 1), randn(*shape, seed=s + 2))
        for s in (10, 20)
    ]
    meta = (base.block_table, base.seq_lens, base.scale)
    plan = decode_plan(base.block_table, base.seq_lens, base.k_cache)
    planned = [decode_call((*layer, *meta), plan) for layer in layers]
    for layer, out in zip(layers, planned, strict=True):
        assert_close(out, naive.paged_decode_attention(*layer, *meta), ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_prefill_with_plan_equals_without(dtype: torch.dtype, backend: str) -> None:
    batch = make_paged_batch([20, 40, 9], [0, 5, 9], 6, 2, HEAD_DIM, PAGE_SIZE, dtype, seed=4)
    slots = torch.full((batch.q.shape[0],), -1, dtype=torch.int64)
    plan = paged_kernels.plan_attention(
        batch.block_table, batch.seq_lens, batch.cu_seqlens_q, slots, batch.k_cache,
        backend=backend,
    )  # fmt: skip
    assert plan.max_new_tokens == 9
    args = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.scale,
    )

    def call(plan: paged_kernels.AttentionPlan | None) -> torch.Tensor:
        return paged_kernels.paged_prefill_attention(*args, backend=backend, plan=plan)

    outside = call(None)
    first, again = call(plan), call(plan)
    assert torch.equal(first, outside) and torch.equal(again, outside)
    assert_close(outside, naive.paged_prefill_attention(*args), ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_store_kv_with_plan_equals_without(dtype: torch.dtype) -> None:
    """Two layers store with one slot tensor: with a plan the second reuses the kept slots."""
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

    want, outside, planned = fresh_caches(), fresh_caches(), fresh_caches()
    table = torch.zeros((1, 5), dtype=torch.int32)
    plan = paged_kernels.plan_attention(
        table, torch.tensor([6], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32),
        slots, planned[0][0], backend="torch",
    )  # fmt: skip
    assert plan.kept_slots is not None and plan.kept_slots.keep is not None
    for (k, v), (kc, vc) in zip(layer_kv, want, strict=True):
        naive.store_kv(k, v, kc, vc, slots)
    for (k, v), (kc, vc) in zip(layer_kv, outside, strict=True):
        paged_kernels.store_kv(k, v, kc, vc, slots, backend="torch")
    for (k, v), (kc, vc) in zip(layer_kv, planned, strict=True):
        paged_kernels.store_kv(k, v, kc, vc, slots, backend="torch", plan=plan)
    for (wk, wv), (ok, ov), (sk, sv) in zip(want, outside, planned, strict=True):
        assert_close(ok, wk, STORE_TOL)
        assert_close(ov, wv, STORE_TOL)
        assert torch.equal(sk, ok) and torch.equal(sv, ov)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_with_plan_equals_without(layout: str) -> None:
    cache = paged_kernels.rotary_cache(64, HEAD_DIM, THETA)
    positions = torch.arange(9, 16)
    plan = paged_kernels.plan_rotary(positions, cache, layout, backend="torch")
    fused = fused_qkv_views(7, 6, 2, HEAD_DIM, torch.float32)[1:]
    separate = (randn(7, 6, HEAD_DIM, seed=5), randn(7, 2, HEAD_DIM, seed=6))
    for q, k in (fused, separate):

        def call(
            plan: paged_kernels.RotaryPlan | None, q: torch.Tensor = q, k: torch.Tensor = k
        ) -> torch.Tensor:
            rotated = paged_kernels.rotary(q, k, positions, cache, layout, backend="torch",
                                           plan=plan)
            return torch.cat(rotated, 1)

        outside = call(None)
        first, again = call(plan), call(plan)
        assert torch.equal(first, outside) and torch.equal(again, outside)
        ref_q, ref_k = naive.rotary(q, k, positions, HEAD_DIM, THETA, layout)
        assert_close(outside, torch.cat([ref_q, ref_k], 1), ROTARY_TOL[torch.float32])


def test_plan_refuses_a_call_it_was_not_built_for() -> None:
    """A plan names its tensors, cache geometry, backend and layout; any other call is refused."""
    batch = make_paged_batch([40, 33], [1, 1], 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.scale)
    plan = decode_plan(batch.block_table, batch.seq_lens, batch.k_cache)
    equal_copy = (*args[:3], batch.block_table.clone(), *args[4:])
    with pytest.raises(ValueError, match="another block_table"):
        decode_call(equal_copy, plan)  # type: ignore[arg-type]
    bigger = torch.zeros((batch.k_cache.shape[0] + 1, *batch.k_cache.shape[1:]))
    with pytest.raises(ValueError, match="plan built for a cache"):
        decode_call((args[0], bigger, bigger, *args[3:]), plan)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        paged_kernels.paged_decode_attention(*args, backend="triton", plan=plan)
    cache = paged_kernels.rotary_cache(64, HEAD_DIM, THETA)
    positions = torch.arange(3)
    rot = paged_kernels.plan_rotary(positions, cache, "half", backend="torch")
    q, k = randn(3, 2, HEAD_DIM), randn(3, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="layout"):
        paged_kernels.rotary(q, k, positions, cache, "interleaved", backend="torch", plan=rot)
    with pytest.raises(ValueError, match="other positions"):
        paged_kernels.rotary(q, k, positions.clone(), cache, "half", backend="torch", plan=rot)


def test_new_plan_sees_metadata_changed_between_steps() -> None:
    """The engine may refill its metadata tensors between steps: each step's plan re-reads."""
    batch = make_paged_batch([40, 33, 48], [1] * 3, 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    seq_lens = batch.seq_lens.clone()
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, seq_lens, batch.scale)
    for lens in ([40, 33, 48], [41, 34, 48], [3, 33, 20]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out = decode_call(args, decode_plan(batch.block_table, seq_lens, batch.k_cache))
        assert_close(out, naive.paged_decode_attention(*args), ATTENTION_TOL[torch.float32])
    seq_lens.fill_(1000)
    with pytest.raises(ValueError, match="exceeds block_table capacity"):
        decode_plan(batch.block_table, seq_lens, batch.k_cache)


def raises_with_and_without_plan(
    call: Callable[[], object], make_plan: Callable[[], object], error: type[Exception], match: str
) -> None:
    """The op refuses bad input on its own, and building the step's plan refuses it too."""
    for _ in range(2):  # a failed check leaves nothing behind that lets the next call through
        with pytest.raises(error, match=match):
            call()
    with pytest.raises(error, match=match):
        make_plan()


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_seq_lens_beyond_block_table_raises(kind: str) -> None:
    batch = make_paged_batch([20, 9], [4, 9], 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    good_lens = batch.seq_lens
    bad_lens = torch.tensor([20, 2 * PAGE_SIZE + 1], dtype=torch.int32)  # 2 pages hold 32

    def call(seq_lens: torch.Tensor) -> torch.Tensor:
        if kind == "decode":
            return paged_kernels.paged_decode_attention(
                batch.q[:2],
                batch.k_cache,
                batch.v_cache,
                batch.block_table,
                seq_lens,
                batch.scale,
                backend="torch",
            )
        return paged_kernels.paged_prefill_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_table,
            batch.cu_seqlens_q,
            seq_lens,
            batch.scale,
            backend="torch",
        )

    call(good_lens)  # a good call first does not let a bad one through
    raises_with_and_without_plan(
        lambda: call(bad_lens),
        lambda: decode_plan(batch.block_table, bad_lens, batch.k_cache),
        ValueError,
        "exceeds block_table capacity",
    )


def test_slot_beyond_cache_raises() -> None:
    k = randn(3, 1, HEAD_DIM)
    big = (randn(4, 8, 1, HEAD_DIM), randn(4, 8, 1, HEAD_DIM))  # 32 slots
    small = (randn(2, 8, 1, HEAD_DIM), randn(2, 8, 1, HEAD_DIM))  # 16 slots
    slots = torch.tensor([0, 1, 16])
    meta = (
        torch.zeros((1, 1), dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        slots,
    )
    raises_with_and_without_plan(
        lambda: paged_kernels.store_kv(k, k, *small, slots),
        lambda: paged_kernels.plan_attention(*meta, small[0]),
        ValueError,
        "cache capacity",
    )
    plan = paged_kernels.plan_attention(*meta, big[0])
    paged_kernels.store_kv(k, k, *big, slots, plan=plan)
    assert torch.equal(big[0][2, 0], k[2])
    with pytest.raises(ValueError, match="plan built for a cache"):  # a plan fits one geometry
        paged_kernels.store_kv(k, k, *small, slots, plan=plan)


def test_position_beyond_rotary_cache_raises() -> None:
    q, k = randn(3, 2, HEAD_DIM), randn(3, 1, HEAD_DIM)
    positions = torch.tensor([0, 5, 40])
    small = paged_kernels.rotary_cache(16, HEAD_DIM, THETA)
    raises_with_and_without_plan(
        lambda: paged_kernels.rotary(q, k, positions, small),
        lambda: paged_kernels.plan_rotary(positions, small),
        ValueError,
        "positions must lie in",
    )
    big = paged_kernels.rotary_cache(64, HEAD_DIM, THETA)
    plan = paged_kernels.plan_rotary(positions, big)
    paged_kernels.rotary(q, k, positions, big, plan=plan)
    with pytest.raises(ValueError, match="another cos/sin table"):
        paged_kernels.rotary(q, k, positions, small, plan=plan)


@pytest.mark.parametrize(
    "lens", [pytest.param([20, 20], id="padded"), [60, 5]], ids=str
)
@pytest.mark.parametrize("planned", [False, True])
def test_decode_page_id_beyond_cache_raises(lens: list[int], planned: bool) -> None:
    """A sequence's own page id past the cache is bad input on every decode path (the padded
    path once read it silently as the last page)."""
    batch = make_paged_batch(lens, [1, 1], 6, 2, HEAD_DIM, PAGE_SIZE, torch.float16)
    num_pages = batch.k_cache.shape[0]
    block_table = batch.block_table.clone()
    block_table[0, 1] = num_pages + 5  # token 16 of sequence 0 lives in this page
    args = (batch.q, batch.k_cache, batch.v_cache, block_table, batch.seq_lens, batch.scale)
    padded = torch_attention.decode_read_plan(block_table, batch.seq_lens, PAGE_SIZE, num_pages)
    assert (padded.pages is not None) == (lens == [20, 20])
    with pytest.raises(IndexError):  # the reference cannot read it either
        naive.paged_decode_attention(*args)
    with pytest.raises(ValueError, match="outside the cache"):
        if planned:
            decode_plan(block_table, batch.seq_lens, batch.k_cache)
        else:
            decode_call(args)


@pytest.mark.parametrize("limit_pages", [None, 6, 5])
def test_cpu_float32_decode_pads_only_under_the_gather_limit(
    limit_pages: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 CPU batch of similar lengths is read padded (one call per layer) while its
    gather fits ``PADDED_GATHER_BYTES``, sequence by sequence past it; both equal the naive
    reference, and a padded read trims to the longest sequence (no junk past it is read)."""
    batch = make_paged_batch([20, 31, 25], [1] * 3, 6, 2, HEAD_DIM, PAGE_SIZE, torch.float32)
    page_bytes = 2 * batch.k_cache[0].numel() * batch.k_cache.element_size()
    if limit_pages is not None:
        monkeypatch.setattr(torch_attention, "PADDED_GATHER_BYTES", limit_pages * page_bytes)
    plan = decode_plan(batch.block_table, batch.seq_lens, batch.k_cache)
    assert plan.decode_reads is not None
    padded = limit_pages is None or limit_pages >= 3 * 2  # 3 sequences x 2 pages
    assert (plan.decode_reads.pages is not None) == padded
    if padded:
        assert plan.decode_reads.padded_len == 31
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.scale)
    want = naive.paged_decode_attention(*args)
    assert_close(decode_call(args, plan), want, ATTENTION_TOL[torch.float32])
    for b, length in enumerate([20, 31, 25]):  # junk past each length changes nothing
        page = int(batch.block_table[b, length // PAGE_SIZE])
        batch.k_cache[page, length % PAGE_SIZE :] = 1e4
    assert_close(decode_call(args, plan), want, ATTENTION_TOL[torch.float32])
