"""Triton store_kv, rms_norm, rotary and silu_and_mul under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

import paged_kernels
from paged_kernels import naive

from .kernels_cases import NORM_TOL, ROTARY_TOL, SILU_TOL, assert_close

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 64), (3, 128), (2, 48)], ids=str)  # (Hkv, D)
def test_triton_store_kv_matches_naive(shape: tuple[int, int], dtype: torch.dtype) -> None:
    heads, head_dim = shape
    k_cache = randn(5, 8, heads, head_dim, dtype=dtype)
    v_cache = randn(5, 8, heads, head_dim, dtype=dtype, seed=1)
    k, v = randn(9, heads, head_dim, dtype=dtype, seed=2), randn(9, heads, head_dim, dtype=dtype,
                                                                   seed=3)
    slots = torch.tensor([0, -1, 7, 8, 39, -5, 20, 21, 13], dtype=torch.int64)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    naive.store_kv(k, v, want_k, want_v, slots)
    paged_kernels.store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_triton_store_kv_strided_input() -> None:
    """k, v may be views into a fused QKV projection (row stride larger than Hkv * D)."""
    qkv = randn(4, 5, 64)  # [T, Hq + 2 * Hkv, D] with Hq = 3, Hkv = 1
    k, v = qkv[:, 3:4], qkv[:, 4:5]
    k_cache, v_cache = torch.zeros(2, 8, 1, 64), torch.zeros(2, 8, 1, 64)
    paged_kernels.store_kv(k, v, k_cache, v_cache, torch.tensor([3, 9, -1, 15], dtype=torch.int32),
                     backend="triton")
    assert torch.equal(k_cache[0, 3], k[0]) and torch.equal(v_cache[1, 1], v[1])
    assert torch.equal(k_cache[1, 7], k[3]) and int((k_cache != 0).any(-1).sum()) == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_triton_rms_norm_matches_naive(hidden: int, dtype: torch.dtype) -> None:
    x, w = randn(5, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    out = paged_kernels.rms_norm(x, w, 1e-5, backend="triton")
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, naive.rms_norm(x, w, 1e-5), NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rms_norm_fused_residual(dtype: torch.dtype) -> None:
    x, res = randn(2, 3, 576, dtype=dtype), randn(2, 3, 576, dtype=dtype, seed=1)
    w = randn(576, dtype=dtype, seed=2)
    normed, new_res = paged_kernels.rms_norm(x, w, 1e-6, residual=res, backend="triton")
    assert torch.equal(new_res, x + res)
    assert_close(normed, naive.rms_norm(x + res, w, 1e-6), NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_rotary_matches_naive(head_dim: int, layout: str, dtype: torch.dtype) -> None:
    q, k = randn(4, 3, head_dim, dtype=dtype), randn(4, 1, head_dim, dtype=dtype, seed=1)
    positions = torch.tensor([0, 15, 63, 300])
    cache = paged_kernels.rotary_cache(512, head_dim, 10000.0)
    q_rot, k_rot = paged_kernels.rotary(q, k, positions, cache, layout=layout, backend="triton")
    want_q, want_k = naive.rotary(q, k, positions, head_dim, 10000.0, layout)
    assert q_rot.dtype == dtype and k_rot.shape == k.shape
    assert_close(q_rot, want_q, ROTARY_TOL[dtype])
    assert_close(k_rot, want_k, ROTARY_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (3, 3072), (2, 3, 300)], ids=str)
def test_triton_silu_and_mul_matches_naive(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = randn(*shape, dtype=dtype) * 4  # reaches the saturated ends of the sigmoid
    out = paged_kernels.silu_and_mul(x, backend="triton")
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, naive.silu_and_mul(x), SILU_TOL[dtype])


@pytest.mark.parametrize("tokens", [33, 70])
def test_triton_ops_over_several_row_blocks(tokens: int) -> None:
    """More rows than one program takes (32 in the interpreter): every block, tail masked.
    q and k are views of one fused QKV row, as the engine passes them."""
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=tokens)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    positions = torch.arange(5, 5 + tokens)
    cache = paged_kernels.rotary_cache(128, head_dim, 10000.0)
    q_rot, k_rot = paged_kernels.rotary(q, k, positions, cache, layout="half", backend="triton")
    want_q, want_k = naive.rotary(q, k, positions, head_dim, 10000.0, "half")
    assert_close(q_rot, want_q, ROTARY_TOL[torch.float32])
    assert_close(k_rot, want_k, ROTARY_TOL[torch.float32])

    slots = torch.randperm(12 * 8, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[3] = -1
    k_cache = torch.zeros(12, 8, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    naive.store_kv(k, v, want_k_cache, want_v_cache, slots)
    paged_kernels.store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)

    x, res, w = randn(tokens, 64, seed=2), randn(tokens, 64, seed=3), randn(64, seed=4)
    normed, summed = paged_kernels.rms_norm(x, w, 1e-5, residual=res, backend="triton")
    assert torch.equal(summed, x + res)
    assert_close(normed, naive.rms_norm(x + res, w, 1e-5), NORM_TOL[torch.float32])

    gate_up = randn(tokens, 2 * 96, seed=5)
    assert_close(
        paged_kernels.silu_and_mul(gate_up, backend="triton"),
        naive.silu_and_mul(gate_up),
        SILU_TOL[torch.float32],
    )
