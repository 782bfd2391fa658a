"""Native (C, AVX2 + scalar) block-quantized matrix products for the CPU decode path."""

from engine.native.block_gemm import BlockGemm, QuantizedActivations, native_gemm
from engine.native.build import NativeBuildError, build_library, load_library

__all__ = [
    "BlockGemm",
    "NativeBuildError",
    "QuantizedActivations",
    "build_library",
    "load_library",
    "native_gemm",
]
