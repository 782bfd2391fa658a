"""Native (C, AVX2 + scalar) code for the CPU decode path: block-quantized matrix products
(`block_gemm.c`), a whole decode step in one call (`decode_step.c`, bound in
`engine.native_step`) and greedy sampling's argmax over logit rows (`argmax.c`)."""

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
