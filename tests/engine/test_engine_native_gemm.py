"""The native block-quantized kernels against an independent float64 reference.

Reference: the weights dequantized by the `gguf` library from the blocks' GGUF bytes, times the
activations in float64: below the library's float-tile row count quantized per block of 32 to
int16 by torch (max|x| / 32767, round half to even), from there on as they are, except on the
BF16 path up to its row limit, where torch rounds both x and W to bfloat16 first.
The scalar, AVX2, AVX-512 and AVX-512 BF16 code, T in 1..9 and 17 (int16, bfloat16 and float
tiles, partial tiles), odd out_features.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.native import BlockGemm, NativeBuildError, build_library, load_library
from engine.native.block_gemm import bind, native_gemm
from engine.native.build import NativeSettings
from engine.quant_blocks import (
    Q4_1Blocks,
    Q8_0Blocks,
    QuantBlocks,
    quantize_q4_1,
    quantize_q8_0,
)

# (out_features, in_features); (11, 1600): rows in three K chunks of the float panels, and
# panels of 6, 4 and 1 weight rows
SHAPES = [(33, 64), (7, 96), (130, 32), (5, 576), (11, 1600)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17]  # AVX-512: fused tiles up to 8 rows, panels past it
GGML_TYPE = {Q4_1Blocks: GGMLQuantizationType.Q4_1, Q8_0Blocks: GGMLQuantizationType.Q8_0}
QUANTIZERS = {"q4_1": quantize_q4_1, "q8_0": quantize_q8_0}


@pytest.fixture(scope="module")
def library() -> object:
    lib = load_library()
    if lib is None:
        pytest.fail("the native library did not build (gcc is required for the tests)")
    return lib


PATHS = ["scalar", "avx2", "avx512", "avx512bf16"]


def _gemms(lib: object) -> list[BlockGemm]:
    """Every code path this CPU runs."""
    found = [BlockGemm.named(lib, path) for path in PATHS]  # type: ignore[arg-type]
    return [g for g in found if g is not None]


@pytest.fixture(scope="module", params=PATHS)
def gemm(request: pytest.FixtureRequest, library: object) -> BlockGemm:
    found = BlockGemm.named(library, request.param)  # type: ignore[arg-type]
    if found is None:
        pytest.skip(f"this CPU cannot run the {request.param} code")
    return found


def reference_weight(blocks: QuantBlocks) -> np.ndarray:
    """float64 W [out, in] dequantized by the gguf library from the GGUF bytes."""
    raw = blocks.to_gguf()
    return np.asarray(dequantize(raw, GGML_TYPE[type(blocks)]), dtype=np.float64)


def reference_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int16 codes [T, K], float64 dequantized x [T, K]) of x quantized per block of 32."""
    t, k = x.shape
    groups = x.reshape(t, k // 32, 32)
    scale = groups.abs().amax(dim=-1) / 32767.0  # float32, as the kernel computes it
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros(()))
    codes = torch.round(groups * inv[..., None])
    deq = codes.double() * scale.double()[..., None]
    return codes.to(torch.int16).reshape(t, k), deq.reshape(t, k)


def _problem(grid: str, n: int, k: int, t: int) -> tuple[QuantBlocks, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * n + k + t)
    w = torch.randn(n, k, generator=gen) * 0.05 + 0.01
    x = torch.randn(t, k, generator=gen) * 3.0
    x[:, :32] *= 100  # blocks of very different magnitude
    return QUANTIZERS[grid](w), x


def _run(gemm: BlockGemm, blocks: QuantBlocks, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    assert isinstance(blocks, (Q4_1Blocks, Q8_0Blocks))
    return gemm.matmul(bind(blocks), x, threads)


@pytest.mark.parametrize("grid", ["q4_1", "q8_0"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("t", ROWS)
def test_kernel_matches_float64_reference(
    gemm: BlockGemm, grid: str, n: int, k: int, t: int
) -> None:
    blocks, x = _problem(grid, n, k, t)
    codes, x_deq = reference_activations(x)
    if t >= gemm.float_tile_rows:
        x_deq = x.double()  # float tiles: no activation rounding
    w_ref = torch.from_numpy(reference_weight(blocks))  # [n, k] float64
    if gemm.rounds_to_bf16(t):
        x_deq, w_ref = x_deq.bfloat16().double(), w_ref.float().bfloat16().double()
    expected = x_deq @ w_ref.t()  # [t, n] float64
    got = _run(gemm, blocks, x)
    assert got.shape == (t, n) and got.dtype == torch.float32
    # float32 accumulation of k products: error ~ k * 2^-24 * sum |x_j w_j|
    tol = 8 * k * 2**-24 * (x_deq.abs() @ w_ref.abs().t()) + 1e-6
    assert bool(((got.double() - expected).abs() <= tol).all())
    assert torch.equal(gemm.quantize_activations(x).codes, codes)


@pytest.mark.parametrize("grid", ["q4_1", "q8_0"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_native_dequantize_is_the_reference_weight(
    gemm: BlockGemm, grid: str, n: int, k: int
) -> None:
    blocks, _ = _problem(grid, n, k, 1)
    got = gemm.dequantize(blocks, 2)
    assert torch.equal(got.double(), torch.from_numpy(reference_weight(blocks)))


@pytest.mark.parametrize("grid", ["q4_1", "q8_0"])
def test_threads_and_code_paths_agree(library: object, grid: str) -> None:
    """Float products agree across paths; the BF16 path, which rounds x and W first, agrees
    with itself. A row's sum never depends on the thread split."""
    blocks, x = _problem(grid, 131, 96, 5)
    gemms = _gemms(library)
    for family in ([g for g in gemms if not g.bf16], [g for g in gemms if g.bf16]):
        outputs = [_run(g, blocks, x, threads) for g in family for threads in (1, 2, 3)]
        for out in outputs[1:]:
            torch.testing.assert_close(out, outputs[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("grid", ["q4_1", "q8_0"])
def test_blocks_dequantize_like_the_gguf_library(grid: str) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(9, 96, generator=gen)
    blocks = QUANTIZERS[grid](w)
    deq = blocks.dequantize()
    assert torch.equal(deq.double(), torch.from_numpy(reference_weight(blocks)))
    again = type(blocks).from_gguf(blocks.to_gguf())  # bytes survive a round trip
    assert np.array_equal(again.to_gguf(), blocks.to_gguf())
    step = (w.reshape(9, 3, 32).amax(-1) - w.reshape(9, 3, 32).amin(-1)) / 15  # Q4_1 step
    if grid == "q8_0":
        step = w.reshape(9, 3, 32).abs().amax(-1) / 127
    bound = step * 0.5 * (1 + 2**-9) + 2**-10 * w.reshape(9, 3, 32).abs().amax(-1)
    err = (deq - w).abs().reshape(9, 3, 32)
    assert bool((err <= bound[..., None] + 1e-7).all())
    assert blocks.nbytes() == 9 * 3 * (20 if grid == "q4_1" else 34)


def test_kernel_refuses_bad_input(library: object) -> None:
    gemm = BlockGemm(library, avx2=False)  # type: ignore[arg-type]
    blocks = quantize_q4_1(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"expected x \[T, 64\]"):
        gemm.matmul(bind(blocks), torch.randn(2, 32), 1)
    with pytest.raises(ValueError, match="float32"):
        gemm.matmul(bind(blocks), torch.randn(2, 64, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q8_0(torch.randn(4, 40))
    with pytest.raises(ValueError, match="codes must be uint8"):
        Q4_1Blocks(blocks.codes[:, :1], blocks.scales, blocks.mins)


def test_non_contiguous_activations_are_copied(library: object) -> None:
    gemm = BlockGemm(library, avx2=False)  # type: ignore[arg-type]
    blocks = quantize_q8_0(torch.randn(6, 64))
    x = torch.randn(64, 3).t()  # [3, 64], not contiguous
    bound = bind(blocks)
    assert torch.equal(gemm.matmul(bound, x, 2), gemm.matmul(bound, x.contiguous(), 2))


def test_build_is_cached_by_source_hash(tmp_path: Path) -> None:
    first = build_library(tmp_path)
    assert first.parent == tmp_path and first.name.startswith("native-")
    mtime = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first and first.stat().st_mtime_ns == mtime


def test_missing_compiler_falls_back_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-prefixgate")
    monkeypatch.setenv("PREFIXGATE_NATIVE_CACHE", str(tmp_path))
    with pytest.raises(NativeBuildError, match="no C compiler"):
        build_library(tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine.native.build"):
        assert load_library.__wrapped__() is None
    assert len(caplog.records) == 1 and "torch's kernels" in caplog.records[0].getMessage()


def test_settings_reject_unknown_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXGATE_NATIVE_GEMM", "fast")
    with pytest.raises(ValueError, match="PREFIXGATE_NATIVE_GEMM"):
        NativeSettings.from_env()
    monkeypatch.setenv("PREFIXGATE_NATIVE_GEMM", "off")
    assert load_library.__wrapped__() is None


@pytest.mark.parametrize(("mode", "want"), [("auto", None), ("avx512", "avx512"), ("avx2", "avx2"),
                                          ("scalar", "scalar")])
def test_settings_choose_the_code_path(
    monkeypatch: pytest.MonkeyPatch, library: object, mode: str, want: str | None
) -> None:
    """"auto" takes the widest code the CPU runs; "avx512" keeps bfloat16 off; "avx2" AVX-512
    too; "scalar" all three."""
    best = BlockGemm.best(library)  # type: ignore[arg-type]
    monkeypatch.setenv("PREFIXGATE_NATIVE_GEMM", mode)
    native_gemm.cache_clear()
    try:
        got = native_gemm()
    finally:
        monkeypatch.undo()
        native_gemm.cache_clear()
    assert got is not None
    if want is None:
        assert (got.avx2, got.avx512, got.bf16, got.level) == (
            best.avx2, best.avx512, best.bf16, best.level)
    elif want == "avx512":
        assert (got.avx512, got.bf16, got.level) == (best.avx512, False, 2 if best.avx512 else
                                                     int(best.avx2))
    elif want == "avx2":
        assert (got.avx2, got.avx512, got.level) == (best.avx2, False, int(best.avx2))
    else:
        assert (got.avx2, got.avx512, got.level) == (False, False, 0)
