"""Workloads for ``bench_kernels.py``: paged-attention shapes, their inputs and the
gathered-pages SDPA baselines the Triton kernels are compared with."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ENGINE = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
LLAMA8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


@dataclass(frozen=True)
class AttnShape:
    """One attention workload: heads, head dim, page size, batch and context per sequence."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    batch: int
    context: int  # tokens per sequence (decode: in cache; prefill: prefix + new)
    new_tokens: int = 1  # prefill: new tokens per sequence

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads or not 1 <= self.new_tokens <= self.context:
            raise ValueError(f"inconsistent shape {self}")


@dataclass(frozen=True)
class PagedInputs:
    """A paged cache holding ``batch`` sequences in shuffled pages, plus their block table."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    scale: float


def make_inputs(shape: AttnShape, dtype: torch.dtype, device: torch.device) -> PagedInputs:
    """Random K/V in a random page order (pages of one sequence are not adjacent)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    pages_per_seq = -(-shape.context // shape.page_size)
    num_pages = shape.batch * pages_per_seq
    cache_shape = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_table = order.view(shape.batch, pages_per_seq).to(device)
    n_q = shape.batch * shape.new_tokens
    q = torch.randn(n_q, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    cu = torch.arange(0, n_q + 1, shape.new_tokens, dtype=torch.int32, device=device)
    return PagedInputs(q, k_cache, v_cache, block_table, seq_lens, cu, shape.head_dim**-0.5)


def decode_bytes(shape: AttnShape, elem: int) -> int:
    kv = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim
    q_and_out = 2 * shape.batch * shape.num_q_heads * shape.head_dim
    return (kv + q_and_out) * elem


def gathered_sdpa_decode(x: PagedInputs) -> torch.Tensor:
    """The obvious baseline: gather every sequence's pages, then SDPA with GQA."""
    k = x.k_cache[x.block_table.long()].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    v = x.v_cache[x.block_table.long()].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=x.q.device)[None, :] < x.seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        x.q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=x.scale, enable_gqa=True
    )  # [B, Hq, 1, D]
    return out.squeeze(2)


def gathered_sdpa_prefill(x: PagedInputs, shape: AttnShape) -> torch.Tensor:
    """Gather pages, then causal SDPA per batch (equal chunks, so one batched call)."""
    k = x.k_cache[x.block_table.long()].flatten(1, 2)[:, : shape.context].transpose(1, 2)
    v = x.v_cache[x.block_table.long()].flatten(1, 2)[:, : shape.context].transpose(1, 2)
    q = x.q.view(shape.batch, shape.new_tokens, shape.num_q_heads, shape.head_dim).transpose(1, 2)
    prefix = shape.context - shape.new_tokens
    pos = torch.arange(prefix, shape.context, device=q.device)
    mask = torch.arange(shape.context, device=q.device)[None, :] <= pos[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=x.scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(x.q.shape)
