"""Projections on the native block-quantized kernels (`engine.native`).

- `Q4_1Linear`: W on GGUF's Q4_1 grid (per block of 32 inputs an fp16 scale and min, 4-bit
  codes): `quantization="int4"`. A Q4_1 GGUF's own blocks are used as they are, so the engine
  computes with exactly llama.cpp's weights.
- `Q8_0Linear`: W on GGUF's Q8_0 grid (per block of 32 an fp16 scale, int8 codes):
  `quantization="int8"`, and the LM head under both int8 and int4 (SmolLM2's GGUF stores its
  tied embedding as Q8_0: those blocks are taken as they are).

Below `FLOAT_GEMM_ROWS` activation rows the products run in C on the blocks: one row (decode)
quantizes x per block of 32 to int16 and runs integer block products (llama.cpp uses int8
there; see block_gemm.c for why not); 2 to 31 rows (batched decode, short verifies) dequantize
each weight block once and multiply the float rows (no activation rounding). From
`FLOAT_GEMM_ROWS` rows on (prefill chunks) they dequantize W in C and run torch's float32 GEMM,
which is faster there (measured on the 2-core AVX2 EPYC, one thread, 3072x576: T=16 1.2 vs
1.3 ms, T=32 3.2 vs 1.9 ms, T=512 44 vs 23 ms). All return float32.
`dequantized()` is exactly the W the kernels multiply by; only a single row's activation
rounding differs from `x @ dequantized().T`. Threads: torch's intra-op count, on torch's own
OpenMP pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import profiler

from engine.config import Quantization
from engine.linear_base import PackedLinear
from engine.native import BlockGemm, native_gemm
from engine.native.block_gemm import bind
from engine.quant_blocks import Q4_1Blocks, Q8_0Blocks, QuantBlocks, quantize_q4_1, quantize_q8_0

FLOAT_GEMM_ROWS = 32  # from this many rows of x on: dequantize + float GEMM (see above)
# Weight format of the LM head per quantization (int4's head stays 8-bit, like llama.cpp's files).
HEAD_GRID: dict[str, type[QuantBlocks]] = {"int8": Q8_0Blocks, "int4": Q8_0Blocks}
PROJECTION_GRID: dict[str, type[QuantBlocks]] = {"int8": Q8_0Blocks, "int4": Q4_1Blocks}


class BlockLinear(PackedLinear):
    """W as GGUF blocks: x [T, in] float32 -> [T, out] float32 on the native kernels."""

    def __init__(self, blocks: Q4_1Blocks | Q8_0Blocks, gemm: BlockGemm) -> None:
        super().__init__()
        self.blocks = blocks
        self._bound = bind(blocks)
        self.gemm = gemm
        self._label = f"native::{type(blocks).__name__.removesuffix('Blocks').lower()}_matmul"

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        if profiler._is_profiler_enabled:  # name the C call in torch.profiler's tables
            with torch.profiler.record_function(self._label):
                return self._forward(x)
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        threads = torch.get_num_threads()
        if x.shape[0] >= FLOAT_GEMM_ROWS:
            return F.linear(x, self.gemm.dequantize(self.blocks, threads))
        return self.gemm.matmul(self._bound, x, threads)

    def dequantized(self) -> Tensor:
        return self.blocks.dequantize()

    def weight_bytes(self) -> int:
        return self.blocks.nbytes()


class Q4_1Linear(BlockLinear):
    """W as Q4_1 blocks (int4)."""

    blocks: Q4_1Blocks


class Q8_0Linear(BlockLinear):
    """W as Q8_0 blocks (int8, and the LM head)."""

    blocks: Q8_0Blocks


def blocks_linear(blocks: QuantBlocks, gemm: BlockGemm) -> PackedLinear:
    """The module that computes with `blocks` as they are."""
    if isinstance(blocks, Q4_1Blocks):
        return Q4_1Linear(blocks, gemm)
    return Q8_0Linear(blocks, gemm)


def native_linear(weight: Tensor, quantization: Quantization) -> PackedLinear | None:
    """W float32 [out, in] quantized to int8's or int4's block grid on the native kernels;
    None when the native library is unavailable (the caller falls back to torch's kernels)."""
    gemm = native_gemm()
    if gemm is None:
        return None
    grid = PROJECTION_GRID[quantization]
    blocks = quantize_q4_1(weight) if grid is Q4_1Blocks else quantize_q8_0(weight)
    return blocks_linear(blocks, gemm.exact())
