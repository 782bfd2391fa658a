"""Linear projections y = x @ W.T in the weight storage formats the CPU decode path can use.

- `DenseLinear`: W in the model dtype (the float32 correctness reference).
- `Fp16DynamicLinear`: W stored as fp16, computed in fp32 (fbgemm `linear_dynamic_fp16`): half
  the weight bytes of fp32, logits within ~0.03 of the fp32 model on SmolLM2-135M.

Decode on a CPU is bound by streaming weights from memory, so fewer bytes per weight is what
makes single-stream decode fast. Measured and rejected (see benchmarks/bench_model_decode.py):
bf16 weights (no AVX512-BF16 here: ~2x slower than fp32), `torch._weight_int8pack_mm` (no fast
AVX2 path: ~10x slower than fp32), and fbgemm dynamic int8 (per-tensor int8 activations: logit
errors up to ~15 on this model, and the quantized-tensor API is deprecated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import QUANTIZATIONS as QUANTIZATIONS  # re-exported: older imports
from engine.config import Quantization as Quantization


class Linear(nn.Module):
    """A bias-free projection x [T, in] -> [T, out]: the interface every weight layout keeps."""

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        raise NotImplementedError

    def dequantized(self) -> Tensor:
        """W [out, in] as float32."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of the weight as held (what a decode step streams)."""
        raise NotImplementedError


class DenseLinear(Linear):
    """W [out, in] stored as a (frozen, initially uninitialised) parameter in the model dtype."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        return F.linear(x, self.weight)

    def dequantized(self) -> Tensor:
        """W [out, in] as float32."""
        return self.weight.float()

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Fp16DynamicLinear(Linear):
    """W stored as fp16, packed for fbgemm; math in fp32."""

    def __init__(self, weight: Tensor) -> None:  # weight [out, in] float
        super().__init__()
        w = weight.detach().float()
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        self._shape = tuple(w.shape)

    def forward(self, x: Tensor) -> Tensor:  # [T, in] float32 -> [T, out] float32
        out: Tensor = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self._packed)
        return out

    def dequantized(self) -> Tensor:
        weight: Tensor = torch.ops.quantized.linear_unpack_fp16(self._packed)[0]
        return weight.float()

    def weight_bytes(self) -> int:
        out_features, in_features = self._shape
        return 2 * out_features * in_features


def quantize_linear(weight: Tensor, quantization: Quantization) -> Linear:
    """A quantised projection module for W [out, in] (float32 weights only)."""
    if weight.dtype != torch.float32:
        raise ValueError(f"quantization needs float32 weights, got {weight.dtype}")
    if quantization == "fp16":
        return Fp16DynamicLinear(weight)
    raise ValueError(f"unknown quantization {quantization!r}; choose from {QUANTIZATIONS}")
