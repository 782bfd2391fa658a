"""Typed ctypes bindings of `block_gemm.c`: y [T, N] = x [T, K] @ W.T for Q4_1 / Q8_0 blocks
(and of `argmax.c`: greedy sampling's argmax over logit rows).

`BlockGemm(lib, avx2=..., avx512=..., bf16=...)` wraps a loaded library; `native_gemm()` is the
process-wide one the engine uses (None when the library is off or cannot be built). Wrappers
check dtypes, shapes and contiguity before handing raw pointers to C; argtypes are set once per
library.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from engine.native.build import NativeSettings, load_library
from engine.quant_blocks import QK, Q4_1Blocks, Q8_0Blocks

# The C functions' status codes (block_gemm.h); 4, a workspace too small, is handled by callers.
_ERRORS = {1: "bad shape or index", 2: "out of memory",
           3: "the CPU lacks the instructions asked for (AVX2/FMA/F16C, AVX-512F, AVX-512 BF16)"}
NEED_WORKSPACE = 4
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class QuantizedActivations(NamedTuple):
    """x [T, K] per block of 32: int16 codes [T, K], scale dx and dx * sum(codes) [T, K/32]."""

    codes: Tensor
    scales: Tensor
    sums: Tensor


def _declare(lib: ctypes.CDLL) -> None:
    lib.pg_cpu_has_avx2.argtypes, lib.pg_cpu_has_avx2.restype = [], _INT
    lib.pg_cpu_has_avx512.argtypes, lib.pg_cpu_has_avx512.restype = [], _INT
    lib.pg_cpu_has_avx512_bf16.argtypes, lib.pg_cpu_has_avx512_bf16.restype = [], _INT
    lib.pg_bf16_min_rows.argtypes, lib.pg_bf16_min_rows.restype = [], _INT
    lib.pg_bf16_max_rows.argtypes, lib.pg_bf16_max_rows.restype = [], _INT
    lib.pg_float_tile_rows.argtypes, lib.pg_float_tile_rows.restype = [], _INT
    lib.pg_quantize_activations.argtypes = [_P, _I64, _I64, _P, _P, _P, _INT]
    lib.pg_quantize_activations.restype = _INT
    lib.pg_q4_1_matmul.argtypes = [_P, _P, _P, _I64, _I64, _P, _I64, _P, _INT, _INT]
    lib.pg_q4_1_matmul.restype = _INT
    lib.pg_q8_0_matmul.argtypes = [_P, _P, _I64, _I64, _P, _I64, _P, _INT, _INT]
    lib.pg_q8_0_matmul.restype = _INT
    lib.pg_q4_1_dequantize.argtypes = [_P, _P, _P, _I64, _I64, _P, _INT, _INT]
    lib.pg_q4_1_dequantize.restype = _INT
    lib.pg_q8_0_dequantize.argtypes = [_P, _P, _I64, _I64, _P, _INT, _INT]
    lib.pg_q8_0_dequantize.restype = _INT
    # model, step, hidden, workspace, workspace bytes (in/out), threads, level
    lib.pg_decode_step.argtypes = [_P, _P, _P, _P, ctypes.POINTER(_I64), _INT, _INT]
    lib.pg_decode_step.restype = _INT
    lib.pg_halves_from_floats.argtypes = [_P, _I64, _P, _INT]
    lib.pg_halves_from_floats.restype = None
    lib.pg_argmax_rows.argtypes, lib.pg_argmax_rows.restype = [_P, _I64, _I64, _P, _INT], _INT


def check_status(status: int, what: str) -> None:
    """Raise RuntimeError naming `what` unless a native call returned 0."""
    if status != 0:
        raise RuntimeError(f"native {what} failed: {_ERRORS.get(status, status)}")


def _activations(x: Tensor, in_features: int) -> Tensor:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected x [T, {in_features}], got {tuple(x.shape)}")
    if x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"expected float32 CPU activations, got {x.dtype} on {x.device}")
    return x.contiguous()


class BoundWeight(NamedTuple):
    """A weight's pointer and shape arguments, taken once: a decode step calls each projection
    once per layer, so per-call Python work matters. Holds the blocks (the pointers' owner)."""

    blocks: Q4_1Blocks | Q8_0Blocks
    args: tuple[int, ...]  # the C function's arguments before x
    out_features: int
    in_features: int


def bind(blocks: Q4_1Blocks | Q8_0Blocks) -> BoundWeight:
    """The arguments the products take for `blocks` (contiguous tensors, checked here)."""
    n, k = blocks.shape
    tensors = [blocks.codes, blocks.scales]
    if isinstance(blocks, Q4_1Blocks):
        tensors.append(blocks.mins)
    if not all(t.is_contiguous() and t.is_cpu for t in tensors):
        raise ValueError("native products need contiguous CPU blocks")
    return BoundWeight(blocks, (*(t.data_ptr() for t in tensors), n, k), n, k)


class BlockGemm:
    """The native block-quantized products of one loaded library: scalar code, AVX2, AVX2 with
    the float products of two or more activation rows in AVX-512, and those of `bf16_min_rows`
    to `bf16_max_rows` rows in BF16 dot products (activations and weights rounded to
    bfloat16)."""

    def __init__(self, lib: ctypes.CDLL, *, avx2: bool, avx512: bool = False,
                 bf16: bool = False) -> None:
        _declare(lib)
        if avx2 and not lib.pg_cpu_has_avx2():
            raise ValueError("avx2=True on a CPU without AVX2/FMA/F16C")
        if avx512 and not (avx2 and lib.pg_cpu_has_avx512()):
            raise ValueError("avx512=True needs avx2=True and a CPU with AVX-512F")
        if bf16 and not (avx512 and lib.pg_cpu_has_avx512_bf16()):
            raise ValueError("bf16=True needs avx512=True and a CPU with AVX-512 BW and BF16")
        self._lib = lib
        self.avx2 = avx2
        self.avx512 = avx512
        self.bf16 = bf16
        # the C entry points' `avx2` argument: 0 portable, 1 AVX2, 2 AVX2 + AVX-512 panels,
        # 3 those and BF16 dot products
        self.level = 3 if bf16 else 2 if avx512 else int(avx2)
        # from this many rows of x on, products multiply float x by dequantized weight blocks
        self.float_tile_rows: int = lib.pg_float_tile_rows()
        # products of bf16_min_rows..bf16_max_rows rows round x and W to bfloat16
        self.bf16_min_rows: int = lib.pg_bf16_min_rows() if bf16 else 0
        self.bf16_max_rows: int = lib.pg_bf16_max_rows() if bf16 else -1
        self._exact: BlockGemm | None = None
        self._q4_1 = lib.pg_q4_1_matmul
        self._q8_0 = lib.pg_q8_0_matmul
        self._argmax = lib.pg_argmax_rows

    @classmethod
    def best(cls, lib: ctypes.CDLL) -> BlockGemm:
        """The widest code the CPU runs: BF16 dot products, AVX-512 panels, AVX2, else the
        scalar code."""
        _declare(lib)
        avx2 = bool(lib.pg_cpu_has_avx2())
        avx512 = avx2 and bool(lib.pg_cpu_has_avx512())
        return cls(lib, avx2=avx2, avx512=avx512,
                   bf16=avx512 and bool(lib.pg_cpu_has_avx512_bf16()))

    @classmethod
    def named(cls, lib: ctypes.CDLL, path: str) -> BlockGemm | None:
        """The code path `path` ("scalar", "avx2", "avx512" (float products, no bfloat16) or
        "avx512bf16"), None when the CPU lacks it."""
        best = cls.best(lib)
        if path == "scalar":
            return cls(lib, avx2=False)
        if path == "avx2":
            return cls(lib, avx2=True) if best.avx2 else None
        if path == "avx512":
            return cls(lib, avx2=True, avx512=True) if best.avx512 else None
        if path == "avx512bf16":
            return best if best.bf16 else None
        raise ValueError(f"unknown code path {path!r}")

    def exact(self) -> BlockGemm:
        """This code path with float32 products of every row count (no bfloat16 rounding)."""
        if not self.bf16:
            return self
        if self._exact is None:  # one per path: every projection of a model asks for it
            self._exact = BlockGemm(self._lib, avx2=self.avx2, avx512=self.avx512)
        return self._exact

    def rounds_to_bf16(self, rows: int) -> bool:
        """Whether a product of `rows` activation rows rounds x and W to bfloat16."""
        return self.bf16_min_rows <= rows <= self.bf16_max_rows

    def matmul(self, w: BoundWeight, x: Tensor, threads: int) -> Tensor:
        """x [T, in] float32 @ W.T -> [T, out] float32 (x quantized per block to int16 below
        `float_tile_rows` rows; from there on float x times dequantized weight blocks)."""
        x = _activations(x, w.in_features)
        y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
        run = self._q4_1 if isinstance(w.blocks, Q4_1Blocks) else self._q8_0
        status = run(*w.args, x.data_ptr(), x.shape[0], y.data_ptr(), threads, self.level)
        if status:
            check_status(status, "matmul")
        return y

    def argmax(self, logits: Tensor) -> Tensor:
        """`logits.argmax(dim=-1)` of float32 CPU logits [N, V], int64 [N] (the first index of
        each row's maximum; a NaN counts as the maximum, as in torch)."""
        if logits.dim() != 2 or logits.shape[1] == 0:
            raise ValueError(f"expected logits [N, V], got {tuple(logits.shape)}")
        logits = _activations(logits, logits.shape[1])
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        status = self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1],
                              out.data_ptr(), self.level)
        check_status(status, "argmax")
        return out

    def decode_step_function(self) -> Callable[..., int]:
        """`pg_decode_step` of this library (bound in `engine.native_step`)."""
        return self._lib.pg_decode_step

    def dequantize(self, w: Q4_1Blocks | Q8_0Blocks, threads: int) -> Tensor:
        """W float32 [out, in], the values the products use (for a float GEMM when T is large)."""
        n, k = w.shape
        out = torch.empty(n, k, dtype=torch.float32)
        if isinstance(w, Q4_1Blocks):
            status = self._lib.pg_q4_1_dequantize(
                w.codes.data_ptr(),
                w.scales.data_ptr(),
                w.mins.data_ptr(),
                n,
                k,
                out.data_ptr(),
                threads,
                self.level,
            )
        else:
            status = self._lib.pg_q8_0_dequantize(
                w.codes.data_ptr(), w.scales.data_ptr(), n, k, out.data_ptr(), threads, self.level
            )
        check_status(status, "dequantization")
        return out

    def halves(self, x: Tensor) -> Tensor:
        """x float32 rounded to float16 as the native step stores K and V (F16C on an AVX2
        path; for tests)."""
        x = x.detach().to(torch.float32).contiguous().cpu()
        out = torch.empty(x.shape, dtype=torch.float16)
        self._lib.pg_halves_from_floats(x.data_ptr(), x.numel(), out.data_ptr(), self.level)
        return out

    def quantize_activations(self, x: Tensor) -> QuantizedActivations:
        """What the products do to x first (exposed for tests and inspection)."""
        if x.dim() != 2 or x.shape[1] % QK:
            raise ValueError(f"expected x [T, K] with K divisible by {QK}, got {tuple(x.shape)}")
        x = _activations(x, x.shape[1])
        t, k = x.shape
        codes = torch.empty(t, k, dtype=torch.int16)
        scales, sums = torch.empty(t, k // QK), torch.empty(t, k // QK)
        status = self._lib.pg_quantize_activations(
            x.data_ptr(), t, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr(), self.level
        )
        check_status(status, "activation quantization")
        return QuantizedActivations(codes, scales, sums)


@functools.cache
def native_gemm() -> BlockGemm | None:
    """The engine's kernels: per PREFIXGATE_NATIVE_GEMM, None when off or not buildable."""
    lib = load_library()
    if lib is None:
        return None
    mode = NativeSettings.from_env().mode
    chosen = BlockGemm.named(lib, mode) if mode != "auto" else None
    # a path the CPU lacks: the widest it has ("avx2" without AVX2 gives the scalar code)
    return chosen or BlockGemm.best(lib)
