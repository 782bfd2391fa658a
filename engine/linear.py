"""Linear projections y = x @ W.T in the weight storage formats the CPU decode path can use.

- `DenseLinear`: W in the model dtype (the float32 correctness reference).
- `Int8DynamicLinear`: W as symmetric per-output-channel int8; activations are quantised per
  tensor on the fly (fbgemm `quantized::linear_dynamic`, AVX2). 4x fewer weight bytes than fp32.
- `Fp16DynamicLinear`: W stored as fp16, computed in fp32 (fbgemm `linear_dynamic_fp16`).

Decode on a CPU is bound by streaming weights from memory, so fewer bytes per weight is what
makes single-stream decode fast. Quantised formats keep float32 inputs and outputs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Quantization = Literal["none", "int8", "fp16"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "fp16")


class DenseLinear(nn.Module):
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


class Int8DynamicLinear(nn.Module):
    """W as per-channel symmetric int8 (scale = max|row| / 127), packed for fbgemm."""

    def __init__(self, weight: Tensor) -> None:  # weight [out, in] float
        super().__init__()
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        qweight = torch.quantize_per_channel(w, scales.double(), zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self._shape = tuple(w.shape)

    def forward(self, x: Tensor) -> Tensor:  # [T, in] float32 -> [T, out] float32
        return torch.ops.quantized.linear_dynamic(x.contiguous(), self._packed, True)

    def dequantized(self) -> Tensor:
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.dequantize()

    def weight_bytes(self) -> int:
        out_features, in_features = self._shape
        return out_features * in_features + 8 * out_features  # int8 values + double scales


class Fp16DynamicLinear(nn.Module):
    """W stored as fp16, packed for fbgemm; math in fp32."""

    def __init__(self, weight: Tensor) -> None:  # weight [out, in] float
        super().__init__()
        w = weight.detach().float()
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        self._shape = tuple(w.shape)

    def forward(self, x: Tensor) -> Tensor:  # [T, in] float32 -> [T, out] float32
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self._packed)

    def dequantized(self) -> Tensor:
        weight, _ = torch.ops.quantized.linear_unpack_fp16(self._packed)
        return weight.float()

    def weight_bytes(self) -> int:
        out_features, in_features = self._shape
        return 2 * out_features * in_features


AnyLinear = DenseLinear | Int8DynamicLinear | Fp16DynamicLinear


def quantize_linear(weight: Tensor, quantization: Quantization) -> nn.Module:
    """A quantised projection module for W [out, in] (float32 weights only)."""
    if weight.dtype != torch.float32:
        raise ValueError(f"quantization needs float32 weights, got {weight.dtype}")
    if quantization == "int8":
        return Int8DynamicLinear(weight)
    if quantization == "fp16":
        return Fp16DynamicLinear(weight)
    raise ValueError(f"unknown quantization {quantization!r}; choose from {QUANTIZATIONS}")
