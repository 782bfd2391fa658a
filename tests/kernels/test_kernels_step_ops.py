"""``paged_kernels.plan_step`` and its ``StepOps``: one layer's glue (norm, fused-QKV rotary, KV
store, attention, SiLU-and-mul) against paged_kernels.naive on ragged decode and prefill batches,
for the torch path and the Triton path (interpreter), and the step checks at the plan boundary."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import pytest
import torch

import paged_kernels
from paged_kernels import naive

from .kernels_cases import (
    ATTENTION_TOL,
    NORM_TOL,
    ROTARY_TOL,
    SILU_TOL,
    PagedBatch,
    assert_close,
    make_paged_batch,
)

THETA = 10000.0
PAGE_SIZE = 8
NUM_KV_HEADS = 2
NUM_HEADS = 6
HEAD_DIM = 16
EPS = 1e-5
LAYERS = 2
# (seq_lens incl. the new tokens, new tokens per sequence)
STEPS = {
    "decode-one": ([21], [1]),
    "decode-batch": ([9, 30, 17], [1, 1, 1]),
    "prefill-ragged": ([12, 5, 19], [4, 5, 1]),
}
NO_TRITON = importlib.util.find_spec("triton") is None
NEEDS_TRITON = pytest.mark.skipif(NO_TRITON, reason="triton is not installed")
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Step(NamedTuple):
    """A step over LAYERS layers: the batch's metadata and cached prefix, one cache per layer."""

    batch: PagedBatch
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    is_decode: bool


def make_step(kind: str, dtype: torch.dtype) -> Step:
    seq_lens, n_new = STEPS[kind]
    batch = make_paged_batch(seq_lens, n_new, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, dtype)
    positions, slots = [], []
    for b, (length, new) in enumerate(zip(seq_lens, n_new, strict=True)):
        for p in range(length - new, length):
            positions.append(p)
            slots.append(int(batch.block_table[b, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE)
    k_caches = [batch.k_cache.clone() for _ in range(LAYERS)]
    v_caches = [batch.v_cache.clone() for _ in range(LAYERS)]
    return Step(
        batch, torch.tensor(positions), torch.tensor(slots), k_caches, v_caches,
        all(n == 1 for n in n_new),
    )  # fmt: skip


def geometry() -> paged_kernels.LayerGeometry:
    return paged_kernels.LayerGeometry(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, EPS, HEAD_DIM**-0.5)


def step_ops(step: Step, layout: str, backend: str, dtype: torch.dtype) -> paged_kernels.StepOps:
    b = step.batch
    attention = paged_kernels.plan_attention(
        b.block_table, b.seq_lens, b.cu_seqlens_q, step.slots, step.k_caches[0],
        is_decode=step.is_decode, backend=backend,
    )  # fmt: skip
    table = paged_kernels.rotary_cache(64, HEAD_DIM, THETA).to(dtype)
    rotary = paged_kernels.plan_rotary(step.positions, table, layout, backend=backend)
    return paged_kernels.plan_step(attention, rotary, step.k_caches, step.v_caches, geometry(),
                                   dtype)


LAYOUTS = ["interleaved", "half"]
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(STEPS))
def test_layer_glue_matches_naive(kind: str, layout: str, dtype: torch.dtype, backend: str) -> None:
    """Per layer: rotate the fused QKV's Q/K, store K/V, attend; every layer's cache and output
    equal naive rotary + store + paged attention over the same caches."""
    step = make_step(kind, dtype)
    ops = step_ops(step, layout, backend, dtype)
    b, width = step.batch, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    tokens = step.positions.shape[0]
    for layer in range(LAYERS):
        qkv = randn(tokens, width, dtype=dtype, seed=10 + layer)
        q0 = qkv[:, : NUM_HEADS * HEAD_DIM].reshape(tokens, NUM_HEADS, HEAD_DIM).clone()
        kv = qkv[:, NUM_HEADS * HEAD_DIM :].reshape(tokens, 2, NUM_KV_HEADS, HEAD_DIM).clone()
        want_q, want_k = naive.rotary(q0, kv[:, 0], step.positions, HEAD_DIM, THETA, layout)
        k_want, v_want = step.k_caches[layer].clone(), step.v_caches[layer].clone()
        naive.store_kv(want_k.to(dtype), kv[:, 1], k_want, v_want, step.slots)
        attend = naive.paged_decode_attention if step.is_decode else naive.paged_prefill_attention
        meta = (b.block_table, b.seq_lens) if step.is_decode else (
            b.block_table, b.cu_seqlens_q, b.seq_lens
        )  # fmt: skip
        want = attend(want_q.to(dtype), k_want, v_want, *meta, geometry().scale)

        q, k, v = ops.split_rotate(qkv)
        assert_close(q, want_q, ROTARY_TOL[dtype])
        assert_close(k, want_k, ROTARY_TOL[dtype])
        assert torch.equal(v, kv[:, 1])
        ops.store_kv(k, v, step.k_caches[layer], step.v_caches[layer])
        assert_close(step.k_caches[layer], k_want, ROTARY_TOL[dtype])
        assert torch.equal(step.v_caches[layer], v_want)
        assert_close(ops.attend(q, step.k_caches[layer], step.v_caches[layer]), want,
                     ATTENTION_TOL[dtype])  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_and_activation_match_naive(dtype: torch.dtype, backend: str) -> None:
    """add_rms_norm: the residual sum and its norm (and the first layer's no-residual form);
    silu_and_mul: the gated activation."""
    ops = step_ops(make_step("prefill-ragged", dtype), "half", backend, dtype)
    x, residual = randn(10, 48, dtype=dtype, seed=1), randn(10, 48, dtype=dtype, seed=2)
    weight = randn(48, dtype=dtype, seed=3)
    first = ops.add_rms_norm(x, None, weight)
    assert torch.equal(first.residual, x)
    assert_close(first.normed, naive.rms_norm(x, weight, EPS), NORM_TOL[dtype])
    later = ops.add_rms_norm(x, residual, weight)
    total = x.float() + residual.float()
    assert_close(later.residual, total, NORM_TOL[dtype])
    assert_close(later.normed, naive.rms_norm(total, weight, EPS), NORM_TOL[dtype])
    gate_up = randn(10, 64, dtype=dtype, seed=4)
    assert_close(ops.silu_and_mul(gate_up), naive.silu_and_mul(gate_up), SILU_TOL[dtype])


def test_torch_glue_equals_public_ops_bit_for_bit() -> None:
    """The torch path in float32 computes what the checked public ops compute, exactly."""
    step = make_step("decode-batch", torch.float32)
    ops = step_ops(step, "interleaved", "torch", torch.float32)
    qkv = randn(3, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, seed=5)
    q_in = qkv[:, : NUM_HEADS * HEAD_DIM].reshape(3, NUM_HEADS, HEAD_DIM).clone()
    k_in = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
    k_in = k_in.reshape(3, NUM_KV_HEADS, HEAD_DIM).clone()
    plan = ops.rotary
    want_q, want_k = paged_kernels.rotary(
        q_in, k_in, plan.positions, plan.cos_sin_cache, "interleaved", backend="torch"
    )
    q, k, _ = ops.split_rotate(qkv)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_plan_step_refuses_a_bad_step() -> None:
    """The step boundary rejects what the per-layer ops no longer check."""
    step = make_step("decode-batch", torch.float32)
    b = step.batch
    attention = paged_kernels.plan_attention(
        b.block_table, b.seq_lens, b.cu_seqlens_q, step.slots, step.k_caches[0],
        is_decode=True, backend="torch",
    )  # fmt: skip
    table = paged_kernels.rotary_cache(64, HEAD_DIM, THETA)
    rotary = paged_kernels.plan_rotary(step.positions, table, "half", backend="torch")
    ks, vs, g = step.k_caches, step.v_caches, geometry()
    with pytest.raises(ValueError, match="one K and one V cache per layer"):
        paged_kernels.plan_step(attention, rotary, ks, vs[:1], g, torch.float32)
    odd = [ks[0], ks[1][:, :, :1].contiguous()]
    with pytest.raises(ValueError, match="layer 1 k_cache"):
        paged_kernels.plan_step(attention, rotary, odd, vs, g, torch.float32)
    with pytest.raises(ValueError, match="layer 1 v_cache"):
        paged_kernels.plan_step(attention, rotary, ks, [vs[0], vs[1].transpose(0, 1)], g,
                                torch.float32)
    with pytest.raises(ValueError, match="KV heads"):
        paged_kernels.plan_step(attention, rotary, ks, vs, g._replace(num_kv_heads=1),
                                torch.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_kernels.plan_step(attention, rotary, ks, vs, g._replace(num_heads=5), torch.float32)
    with pytest.raises(TypeError, match="activations are torch.float16"):
        paged_kernels.plan_step(attention, rotary, ks, vs, g, torch.float16)
    fewer = paged_kernels.plan_rotary(step.positions[:2], table, "half", backend="torch")
    with pytest.raises(ValueError, match="2 positions for a step of 3 tokens"):
        paged_kernels.plan_step(attention, fewer, ks, vs, g, torch.float32)
    bigger = [torch.zeros(20, *ks[0].shape[1:]) for _ in ks]
    with pytest.raises(ValueError, match="plan built for a cache"):
        paged_kernels.plan_step(attention, rotary, bigger, bigger, g, torch.float32)
    claims_decode = _decode_with_two_tokens(b, ks[0])
    with pytest.raises(ValueError, match="one token per sequence, got 3 for 2"):
        paged_kernels.plan_step(claims_decode, rotary, ks, vs, g, torch.float32)


def _decode_with_two_tokens(b: PagedBatch, k_cache: torch.Tensor) -> paged_kernels.AttentionPlan:
    """A plan that claims decode for two sequences with three new tokens in all."""
    seq_lens, table = b.seq_lens[:2], b.block_table[:2]
    cu, slots = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([-1, -1, -1])
    return paged_kernels.plan_attention(table, seq_lens, cu, slots, k_cache, is_decode=True,
                                  backend="torch")  # fmt: skip


def test_plan_step_rejects_bad_metadata_values() -> None:
    """Values are checked where the step's plans are built: a position past the rotary table,
    a slot past the cache, a page outside it."""
    step = make_step("decode-batch", torch.float32)
    b = step.batch
    table = paged_kernels.rotary_cache(64, HEAD_DIM, THETA)
    with pytest.raises(ValueError, match="positions must lie in"):
        paged_kernels.plan_rotary(step.positions + 64, table, "half", backend="torch")
    with pytest.raises(ValueError, match="cache capacity"):
        paged_kernels.plan_attention(
            b.block_table, b.seq_lens, b.cu_seqlens_q, step.slots + 10_000, step.k_caches[0],
            is_decode=True, backend="torch",
        )  # fmt: skip
    bad_table = b.block_table.clone()
    bad_table[0, 0] = 999
    with pytest.raises(ValueError, match="outside the cache"):
        paged_kernels.plan_attention(
            bad_table, b.seq_lens, b.cu_seqlens_q, step.slots, step.k_caches[0],
            is_decode=True, backend="torch",
        )  # fmt: skip


def test_serial_decode_restores_the_thread_count() -> None:
    """A short CPU decode attends on one thread and hands the caller's thread count back, also
    when the attention raises."""
    step = make_step("decode-batch", torch.float32)
    ops = step_ops(step, "interleaved", "torch", torch.float32)
    assert isinstance(ops, paged_kernels.step_ops.TorchStepOps) and ops.serial_decode
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q = randn(3, NUM_HEADS, HEAD_DIM)
        ops.attend(q, step.k_caches[0], step.v_caches[0])
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            ops.attend(q[:, :, :5], step.k_caches[0], step.v_caches[0])  # wrong head_dim
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
