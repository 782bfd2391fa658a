"""The torch path of store_kv, rms_norm, rotary and silu_and_mul against naive references."""

from __future__ import annotations

import pytest
import torch

import paged_kernels
from paged_kernels import naive

from .kernels_cases import NORM_TOL, ROTARY_TOL, SILU_TOL, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_naive_and_skips_negative_slots(
    dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    cache_shape = (6, 8, 3, 64)
    k_cache, v_cache = randn(*cache_shape, dtype=dtype), randn(*cache_shape, dtype=dtype, seed=1)
    k, v = randn(7, 3, 64, dtype=dtype, seed=2), randn(7, 3, 64, dtype=dtype, seed=3)
    slots = torch.tensor([5, -1, 17, 40, -1, 47, 8], dtype=slot_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    naive.store_kv(k, v, want_k, want_v, slots)
    paged_kernels.store_kv(k, v, k_cache, v_cache, slots, backend="torch")
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache[2, 1], k[2]) and torch.equal(v_cache[5, 7], v[5])


def test_store_kv_rejects_bad_slots_and_shapes() -> None:
    cache = randn(2, 8, 1, 64)
    k = randn(3, 1, 64)
    with pytest.raises(ValueError, match="cache capacity"):
        paged_kernels.store_kv(k, k, cache, cache.clone(), torch.tensor([0, 1, 16]))
    with pytest.raises(ValueError, match="must have shape"):
        paged_kernels.store_kv(k[:, :, :32], k[:, :, :32], cache, cache.clone(),
                               torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_matches_naive(hidden: int, dtype: torch.dtype) -> None:
    x, w = randn(13, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    out = paged_kernels.rms_norm(x, w, 1e-5, backend="torch")
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, naive.rms_norm(x, w, 1e-5), NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_fused_residual(dtype: torch.dtype) -> None:
    x, res = randn(2, 5, 576, dtype=dtype), randn(2, 5, 576, dtype=dtype, seed=1)
    w = randn(576, dtype=dtype, seed=2)
    normed, new_res = paged_kernels.rms_norm(x, w, 1e-6, residual=res, backend="torch")
    assert torch.equal(new_res, x + res)
    assert_close(normed, naive.rms_norm(x + res, w, 1e-6), NORM_TOL[dtype])


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face Llama's rotate_half: (x1, x2) -> (-x2, x1) over the two halves."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_naive(head_dim: int, layout: str, dtype: torch.dtype) -> None:
    q, k = randn(11, 9, head_dim, dtype=dtype), randn(11, 3, head_dim, dtype=dtype, seed=1)
    positions = torch.tensor([0, 1, 2, 7, 15, 16, 63, 64, 300, 1000, 2047])
    cache = paged_kernels.rotary_cache(2048, head_dim, 10000.0)
    q_rot, k_rot = paged_kernels.rotary(q, k, positions, cache, layout=layout, backend="torch")
    want_q, want_k = naive.rotary(q, k, positions, head_dim, 10000.0, layout)
    assert q_rot.dtype == dtype and k_rot.shape == k.shape
    assert_close(q_rot, want_q, ROTARY_TOL[dtype])
    assert_close(k_rot, want_k, ROTARY_TOL[dtype])


def test_rotary_half_layout_matches_hugging_face_formula() -> None:
    q, k = randn(6, 4, 64), randn(6, 2, 64, seed=1)
    positions = torch.tensor([0, 3, 9, 100, 101, 511])
    cache = paged_kernels.rotary_cache(512, 64, 100000.0)
    q_rot, _ = paged_kernels.rotary(q, k, positions, cache, layout="half")
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, D]
    want = q * emb.cos() + hf_rotate_half(q) * emb.sin()
    assert_close(q_rot, want, (1e-4, 1e-4))


def test_rotary_interleaved_is_half_on_deinterleaved_dims() -> None:
    q, k = randn(5, 3, 64), randn(5, 1, 64, seed=1)
    positions = torch.tensor([1, 2, 30, 31, 200])
    cache = paged_kernels.rotary_cache(256, 64, 10000.0)
    order = torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])  # GGUF -> HF dims
    q_inter, k_inter = paged_kernels.rotary(q, k, positions, cache, layout="interleaved")
    q_half, k_half = paged_kernels.rotary(q[..., order], k[..., order], positions, cache,
                                          layout="half")
    assert_close(q_inter[..., order], q_half, (1e-6, 1e-6))
    assert_close(k_inter[..., order], k_half, (1e-6, 1e-6))


def test_rotary_rejects_bad_layout_and_positions() -> None:
    q = randn(2, 2, 64)
    cache = paged_kernels.rotary_cache(8, 64, 10000.0)
    with pytest.raises(ValueError, match="layout must be one of"):
        paged_kernels.rotary(q, q, torch.tensor([0, 1]), cache, layout="neox")
    with pytest.raises(ValueError, match="positions must lie"):
        paged_kernels.rotary(q, q, torch.tensor([0, 8]), cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (7, 3072), (2, 3, 256)])
def test_silu_and_mul_matches_naive(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = randn(*shape, dtype=dtype)
    out = paged_kernels.silu_and_mul(x, backend="torch")
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, naive.silu_and_mul(x), SILU_TOL[dtype])


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="must be even"):
        paged_kernels.silu_and_mul(randn(2, 5))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("lead", [0, 1])  # 1: odd storage offsets
def test_rotary_on_views_of_a_fused_qkv(layout: str, lead: int) -> None:
    """The engine passes q and k as views into one QKV projection output."""
    qkv = randn(5, lead + 9 * 64 + 2 * 3 * 64)[:, lead:]
    q, k = qkv[:, : 9 * 64].view(5, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)
    positions = torch.tensor([4, 5, 6, 7, 8])
    cache = paged_kernels.rotary_cache(16, 64, 10000.0)
    q_rot, k_rot = paged_kernels.rotary(q, k, positions, cache, layout=layout)
    want_q, want_k = naive.rotary(q, k, positions, 64, 10000.0, layout)
    assert_close(q_rot, want_q, ROTARY_TOL[torch.float32])
    assert_close(k_rot, want_k, ROTARY_TOL[torch.float32])
