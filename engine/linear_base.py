"""The projection interfaces: `Linear` (every weight layout) and `PackedLinear` (CPU packed or
quantised layouts). Implementations: `engine.linear` (dense, fp16, torch's int8/int4) and
`engine.native_linear` (GGUF blocks on the native kernels)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor, nn


class Linear(nn.Module, ABC):
    """A bias-free projection x [T, in] -> [T, out]: the interface every weight layout keeps."""

    @abstractmethod
    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        """y = x @ W.T."""

    @abstractmethod
    def dequantized(self) -> Tensor:
        """W [out, in] as float32."""

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of the weight as held (what a decode step streams)."""


class PackedLinear(Linear):
    """A projection whose weight lives in a packed/quantised form (CPU only): float32 in and
    out; `weight_bytes()` is the packed size (what a decode step streams); `dequantized()` is
    the float32 weight the module computes with, up to activation rounding."""
