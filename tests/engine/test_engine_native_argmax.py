"""Greedy sampling's native argmax (`engine/native/argmax.c`) against torch.argmax, its
reference: the first index of each row's maximum, a NaN counting as the maximum; AVX2 and
scalar code, rows whose length is not a multiple of the vector width."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.native import BlockGemm, load_library
from engine.sampler import Sampler, SamplingRow


@pytest.fixture(scope="module", params=["scalar", "avx2", "avx512"])
def gemm(request: pytest.FixtureRequest) -> BlockGemm:
    lib = load_library()
    if lib is None:
        pytest.fail("the native library did not build (gcc is required for the tests)")
    found = BlockGemm.named(lib, request.param)
    if found is None:
        pytest.skip(f"this CPU cannot run the {request.param} code")
    return found


def _rows(width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g)
    x[1, width // 3] = x[1, width - 1] = 50.0  # a tie: the first wins
    x[2] = float("-inf")  # nothing allowed (a grammar mask): index 0
    x[3, width // 2] = float("nan")  # a NaN wins over every number
    x[4, width - 1] = float("nan")
    x[4, 0] = float("inf")
    x[5, width - 1] = 99.0  # the maximum in the tail past the last full vector
    x[6] = 0.0  # all equal
    x[7, 0] = 7.0
    return x


@pytest.mark.parametrize("width", [1, 7, 8, 9, 31, 49152 + 5])
def test_argmax_equals_torch(gemm: BlockGemm, width: int) -> None:
    x = _rows(width)
    assert gemm.argmax(x).tolist() == x.argmax(dim=-1).tolist()


def test_argmax_of_a_strided_view_and_bad_shapes(gemm: BlockGemm) -> None:
    x = torch.randn(12, 40)[::3, 5:]  # not contiguous: copied first
    assert gemm.argmax(x).tolist() == x.argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="logits"):
        gemm.argmax(torch.randn(5))
    with pytest.raises(ValueError, match="float32"):
        gemm.argmax(torch.randn(2, 5, dtype=torch.float64))


def test_sampler_uses_the_given_argmax_for_greedy_rows() -> None:
    calls = []

    def spy(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape)
        return torch.tensor([3, 1])

    rows = [SamplingRow(SamplingParams(temperature=0.0), [], torch.Generator())] * 2
    assert Sampler(argmax=spy)(torch.zeros(2, 8), rows) == [3, 1]
    assert calls == [(2, 8)]
    assert Sampler()(torch.eye(2, 8), rows) == [0, 1]


def test_int4_engine_samples_greedily_with_the_native_argmax() -> None:
    engine = Engine(EngineConfig(quantization="int4", num_pages=32, max_num_seqs=2))
    if engine.runner.native_decoder is None:
        pytest.skip("the native decode step is off")
    seen: list[list[int]] = []
    native = engine.sampler._argmax
    assert native is not None

    def checked(logits: torch.Tensor) -> torch.Tensor:
        tokens = native(logits)
        assert tokens.tolist() == logits.argmax(dim=-1).tolist()
        seen.append(tokens.tolist())
        return tokens

    engine.sampler._argmax = checked
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate(["The capital of France is", "1, 2, 3,"], params)
    assert len(seen) >= 6 and all(len(o.token_ids) == 6 for o in outs)


def test_sampler_takes_no_argmax_when_every_row_samples() -> None:
    def refuse(logits: torch.Tensor) -> torch.Tensor:
        raise AssertionError("argmax taken for rows that all sample")

    g = torch.Generator().manual_seed(0)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], g)] * 2
    logits = torch.full((2, 8), -1e9)
    logits[0, 5] = logits[1, 2] = 0.0  # one token holds all the probability of each row
    assert Sampler(argmax=refuse)(logits, rows) == [5, 2]
