"""The torch attention path and the naive reference against textbook dense attention."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import paged_kernels
from paged_kernels import naive

from .kernels_cases import (
    ATTENTION_TOL,
    PagedBatch,
    assert_close,
    dense_causal_attention,
    make_paged_batch,
)

DECODE_LENS = [[1], [15], [63], [300], [1, 15, 63, 300, 17]]
PREFILL_CASES = [  # (seq_lens, new tokens per sequence)
    ([1], [1]),
    ([15], [15]),
    ([63], [20]),
    ([300], [45]),
    ([1, 15, 63, 300], [1, 7, 63, 30]),
    ([20, 40, 9], [0, 5, 9]),
]
GROUPS = [1, 3, 8]  # query heads per KV head
HEAD_DIMS = [64, 128]
NUM_KV_HEADS = 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PAGE_SIZE = 16


def dense_expected(batch: PagedBatch) -> torch.Tensor:
    """Attention of every sequence's new tokens over its dense K/V, concatenated."""
    parts = []
    bounds = batch.cu_seqlens_q.tolist()
    for b in range(len(batch.dense_k)):
        q = batch.q[bounds[b] : bounds[b + 1]]
        parts.append(dense_causal_attention(q, batch.dense_k[b], batch.dense_v[b], batch.scale))
    return torch.cat(parts)


def decode_batch(lens: list[int], group: int, head_dim: int, dtype: torch.dtype) -> PagedBatch:
    return make_paged_batch(
        lens, [1] * len(lens), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, PAGE_SIZE, dtype
    )


def run_decode(fn, batch: PagedBatch, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return fn(
        batch.q, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.scale, **kw
    )


def run_prefill(fn, batch: PagedBatch, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return fn(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.cu_seqlens_q,
        batch.seq_lens,
        batch.scale,
        **kw,
    )


@pytest.mark.parametrize("lens", DECODE_LENS, ids=str)
@pytest.mark.parametrize("group", GROUPS)
def test_naive_decode_matches_dense_attention(lens: list[int], group: int) -> None:
    batch = decode_batch(lens, group, 64, torch.float32)
    assert_close(run_decode(naive.paged_decode_attention, batch), dense_expected(batch),
                 ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
@pytest.mark.parametrize("group", GROUPS)
def test_naive_prefill_matches_dense_attention(
    case: tuple[list[int], list[int]], group: int
) -> None:
    lens, n_new = case
    batch = make_paged_batch(lens, n_new, NUM_KV_HEADS * group, NUM_KV_HEADS, 64, PAGE_SIZE,
                             torch.float32)
    assert_close(run_prefill(naive.paged_prefill_attention, batch), dense_expected(batch),
                 ATTENTION_TOL[torch.float32])


TORCH_CASES = [  # (group, head_dim, dtype): every group in fp32, every dtype at group 3
    *[(group, 64, torch.float32) for group in GROUPS],
    *[(3, head_dim, dtype) for head_dim in HEAD_DIMS for dtype in DTYPES[1:]],
    (3, 128, torch.float32),
]


@pytest.mark.parametrize("config", TORCH_CASES, ids=str)
@pytest.mark.parametrize("lens", DECODE_LENS, ids=str)
def test_torch_decode_matches_naive(lens: list[int], config: tuple[int, int, torch.dtype]) -> None:
    group, head_dim, dtype = config
    batch = decode_batch(lens, group, head_dim, dtype)
    out = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, run_decode(naive.paged_decode_attention, batch), ATTENTION_TOL[dtype])


def test_torch_decode_ragged_batch_takes_both_strategies() -> None:
    """Similar lengths are gathered padded (unmasked when all fill their pages); a very uneven
    batch goes sequence by sequence."""
    for lens in ([40, 45, 33], [48, 48, 48], [300, 1, 2, 1, 3]):
        batch = decode_batch(lens, 3, 64, torch.float32)
        out = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
        assert_close(out, dense_expected(batch), ATTENTION_TOL[torch.float32])


def test_torch_decode_works_in_and_out_of_inference_mode() -> None:
    """The engine runs under inference mode; the CPU gather workspace it leaves behind must not
    break a later call outside it (or the other way round)."""
    batch = decode_batch([63, 40], 3, 64, torch.float32)
    with torch.inference_mode():
        inside = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
    outside = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
    with torch.inference_mode():
        again = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
    expected = run_decode(naive.paged_decode_attention, batch)
    for out in (inside, outside, again):
        assert_close(out, expected, ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("config", TORCH_CASES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_torch_prefill_matches_naive(
    case: tuple[list[int], list[int]], config: tuple[int, int, torch.dtype]
) -> None:
    group, head_dim, dtype = config
    lens, n_new = case
    batch = make_paged_batch(lens, n_new, NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim,
                             PAGE_SIZE, dtype)
    out = run_prefill(paged_kernels.paged_prefill_attention, batch, backend="torch")
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, run_prefill(naive.paged_prefill_attention, batch), ATTENTION_TOL[dtype])


def test_decode_sequence_of_length_zero_gives_zeros() -> None:
    batch = decode_batch([5, 0, 9], 3, 64, torch.float32)
    out = run_decode(paged_kernels.paged_decode_attention, batch, backend="torch")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for b in (0, 2):
        expected = dense_causal_attention(batch.q[b : b + 1], batch.dense_k[b], batch.dense_v[b],
                                          batch.scale)
        assert_close(out[b : b + 1], expected, ATTENTION_TOL[torch.float32])


def test_default_backend_on_cpu_is_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = paged_kernels.torch_attention.paged_decode_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("torch")
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_kernels.torch_attention, "paged_decode_attention", spy)
    run_decode(paged_kernels.paged_decode_attention, decode_batch([4], 1, 64, torch.float32))
    assert calls == ["torch"]


def test_bad_inputs_give_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = decode_batch([20, 3], 3, 64, torch.float32)
    args = (batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens, batch.scale)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_kernels.paged_decode_attention(batch.q[:, :5], *args)
    with pytest.raises(TypeError, match="the KV cache torch.float32"):
        paged_kernels.paged_decode_attention(batch.q.half(), *args)
    with pytest.raises(TypeError, match="block_table must have dtype"):
        paged_kernels.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                       batch.block_table.long(), batch.seq_lens, batch.scale)
    with pytest.raises(ValueError, match="exceeds block_table capacity"):
        paged_kernels.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                             batch.block_table, batch.seq_lens * 10, batch.scale)
    with pytest.raises(ValueError, match="power of two"):
        bad = batch.k_cache.reshape(-1, 12, NUM_KV_HEADS, 64)
        paged_kernels.paged_decode_attention(batch.q, bad, bad, batch.block_table,
                                             batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_kernels.paged_decode_attention(batch.q, *args, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        paged_kernels.paged_decode_attention(batch.q, *args, backend="triton")


def test_prefill_rejects_inconsistent_cu_seqlens() -> None:
    batch = make_paged_batch([10, 4], [10, 4], 6, 2, 64, PAGE_SIZE, torch.float32)
    bad_cu = torch.tensor([0, 12, 14], dtype=torch.int32)  # 12 new tokens but seq_len 10
    with pytest.raises(ValueError, match="new tokens but seq_len"):
        paged_kernels.paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache,
                                              batch.block_table, bad_cu, batch.seq_lens,
                                              batch.scale)
    with pytest.raises(ValueError, match="end at T"):
        paged_kernels.paged_prefill_attention(batch.q[:5], batch.k_cache, batch.v_cache,
                                        batch.block_table, batch.cu_seqlens_q, batch.seq_lens,
                                        batch.scale)


def top_level_imports(path: Path) -> set[str]:
    """Module names a file imports at module level (``from . import x`` counts as ``.x``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            sep = "" if base.endswith(".") else "."
            names.add(base)
            names.update(f"{base}{sep}{alias.name}" for alias in node.names)
    return names


def test_triton_is_imported_only_by_the_triton_modules() -> None:
    """Triton loads on first use, so TRITON_INTERPRET set later still takes effect."""
    package = Path(paged_kernels.__file__).parent
    for path in package.glob("*.py"):
        if path.name.startswith("triton_"):
            continue
        imports = top_level_imports(path)
        eager = {n for n in imports if n.split(".")[0] == "triton" or ".triton_" in n}
        assert not eager, f"{path.name} imports {eager} at module level"
