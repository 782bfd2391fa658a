"""Test inputs for the kernel tests: paged KV batches built from known dense K/V."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (atol, rtol) per output dtype, for attention outputs and for the small ops.
ATTENTION_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
STORE_TOL = (0.0, 0.0)  # a copy is exact
NORM_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
ROTARY_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
SILU_TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@dataclass(frozen=True)
class PagedBatch:
    """A ragged batch whose K/V sit in shuffled pages; dense_k/dense_v are the ground truth."""

    q: torch.Tensor  # [T, Hq, D] (decode: T = B)
    k_cache: torch.Tensor  # [P, page_size, Hkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32, unused entries -1
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    dense_k: list[torch.Tensor]  # per sequence [L, Hkv, D]
    dense_v: list[torch.Tensor]
    scale: float


def make_paged_batch(
    seq_lens: list[int],
    n_new: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V per sequence written into a random permutation of pages (plus spare junk)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # junk outside the sequences
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    block_table = torch.full((len(seq_lens), max(1, max(pages_per_seq))), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, length in enumerate(seq_lens):
        pages = [order.pop() for _ in range(pages_per_seq[b])]
        block_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(length):
            k_cache[pages[t // page_size], t % page_size] = k[t]
            v_cache[pages[t // page_size], t % page_size] = v[t]
        dense_k.append(k)
        dense_v.append(v)
    cu = torch.tensor([0, *torch.tensor(n_new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=cu,
        dense_k=dense_k,
        dense_v=dense_v,
        scale=head_dim**-0.5,
    )


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Textbook attention, head by head: q [n, Hq, D] are the last n of the L positions of
    k, v [L, Hkv, D]; query head h reads KV head h // (Hq // Hkv). Returns float64 [n, Hq, D]."""
    n, num_q_heads, _ = q.shape
    total, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    allowed = torch.ones(n, total, dtype=torch.bool).tril(diagonal=total - n)
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()  # [L, D]
        scores = (q[:, h].double() @ kh.T) * scale  # [n, L]
        scores[~allowed] = float("-inf")
        weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
        out[:, h] = (weights / weights.sum(dim=1, keepdim=True)) @ vh
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    """Compare in float64 with a named (atol, rtol)."""
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)
