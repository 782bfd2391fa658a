"""Weights in blocks of 32 inputs per output row, on GGUF's Q4_1 and Q8_0 grids (pure torch).

`Q4_1Blocks`: per block an fp16 scale d, an fp16 min m and 32 codes q in 0..15 packed two per
byte (byte j: element j in the low nibble, element j + 16 in the high nibble, GGUF's order);
w = d * q + m. `Q8_0Blocks`: per block an fp16 scale d and 32 int8 codes; w = d * q.
The native kernels (`engine.native`) compute with exactly these values. Blocks come from a GGUF
file as-is (`from_gguf`, no dequantise/requantise round trip) or from float weights
(`quantize_q4_1`, `quantize_q8_0`: codes chosen on the stored fp16 grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

QK = 32  # inputs per block
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8


def _check_rows(weight: Tensor) -> tuple[int, int]:
    if weight.dim() != 2:
        raise ValueError(f"block quantization needs a 2-D weight [out, in], got {weight.dim()}-D")
    out_features, in_features = weight.shape
    if in_features % QK:
        raise ValueError(
            f"block quantization needs in_features divisible by {QK}, got {in_features}"
        )
    return out_features, in_features


def _gguf_rows(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """uint8 [rows, blocks per row, block_bytes] view of GGUF tensor bytes [rows, row bytes]."""
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % block_bytes:
        raise ValueError(f"expected uint8 [rows, k * {block_bytes}] block bytes, got "
                         f"{data.dtype} {data.shape}")  # fmt: skip
    return data.reshape(data.shape[0], -1, block_bytes)


def _fp16(blocks: np.ndarray, start: int) -> Tensor:
    """The fp16 field at byte `start` of every block: float16 [rows, blocks]."""
    field = np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(np.ascontiguousarray(field))


@dataclass(frozen=True, slots=True)
class Q4_1Blocks:
    """codes uint8 [out, in/32, 16]; scales and mins float16 [out, in/32]."""

    codes: Tensor
    scales: Tensor
    mins: Tensor

    def __post_init__(self) -> None:
        rows, nb = self.scales.shape
        if self.codes.shape != (rows, nb, 16) or self.codes.dtype != torch.uint8:
            raise ValueError(f"Q4_1 codes must be uint8 [{rows}, {nb}, 16], got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")  # fmt: skip
        if self.scales.dtype != torch.float16 or self.mins.dtype != torch.float16:
            raise ValueError("Q4_1 scales and mins must be float16")
        if self.mins.shape != self.scales.shape:
            raise ValueError("Q4_1 scales and mins must have one shape")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return self.scales.shape[0], self.scales.shape[1] * QK

    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel() + 2 * self.mins.numel()

    def dequantize(self) -> Tensor:
        """W float32 [out, in] = d * q + m."""
        q = torch.cat([self.codes & 0x0F, self.codes >> 4], dim=-1).float()  # [out, nb, 32]
        w = q * self.scales.float()[..., None] + self.mins.float()[..., None]
        return w.reshape(self.shape)

    @classmethod
    def from_gguf(cls, data: np.ndarray) -> Q4_1Blocks:
        """Blocks of a GGUF Q4_1 tensor, bytes [rows, row bytes], taken as they are."""
        blocks = _gguf_rows(data, Q4_1_BLOCK_BYTES)
        codes = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 4:]))
        return cls(codes, _fp16(blocks, 0), _fp16(blocks, 2))

    def to_gguf(self) -> np.ndarray:
        """GGUF Q4_1 bytes [rows, row bytes] (what `from_gguf` reads)."""
        rows, nb = self.scales.shape
        scales = self.scales.numpy().view(np.uint8).reshape(rows, nb, 2)
        mins = self.mins.numpy().view(np.uint8).reshape(rows, nb, 2)
        blocks = np.concatenate([scales, mins, self.codes.numpy()], axis=-1)
        return blocks.reshape(rows, nb * Q4_1_BLOCK_BYTES)

    @staticmethod
    def cat(parts: list[Q4_1Blocks]) -> Q4_1Blocks:
        """Rows of several matrices with one in_features, stacked (a fused projection)."""
        return Q4_1Blocks(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]),
        )


@dataclass(frozen=True, slots=True)
class Q8_0Blocks:
    """codes int8 [out, in/32, 32]; scales float16 [out, in/32]."""

    codes: Tensor
    scales: Tensor

    def __post_init__(self) -> None:
        rows, nb = self.scales.shape
        if self.codes.shape != (rows, nb, QK) or self.codes.dtype != torch.int8:
            raise ValueError(f"Q8_0 codes must be int8 [{rows}, {nb}, {QK}], got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")  # fmt: skip
        if self.scales.dtype != torch.float16:
            raise ValueError("Q8_0 scales must be float16")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return self.scales.shape[0], self.scales.shape[1] * QK

    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel()

    def dequantize(self) -> Tensor:
        """W float32 [out, in] = d * q."""
        return (self.codes.float() * self.scales.float()[..., None]).reshape(self.shape)

    @classmethod
    def from_gguf(cls, data: np.ndarray) -> Q8_0Blocks:
        """Blocks of a GGUF Q8_0 tensor, bytes [rows, row bytes], taken as they are."""
        blocks = _gguf_rows(data, Q8_0_BLOCK_BYTES)
        codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)
        return cls(torch.from_numpy(codes), _fp16(blocks, 0))

    def to_gguf(self) -> np.ndarray:
        """GGUF Q8_0 bytes [rows, row bytes] (what `from_gguf` reads)."""
        rows, nb = self.scales.shape
        scales = self.scales.numpy().view(np.uint8).reshape(rows, nb, 2)
        blocks = np.concatenate([scales, self.codes.numpy().view(np.uint8)], axis=-1)
        return blocks.reshape(rows, nb * Q8_0_BLOCK_BYTES)

    @staticmethod
    def cat(parts: list[Q8_0Blocks]) -> Q8_0Blocks:
        """Rows of several matrices with one in_features, stacked (a fused projection)."""
        return Q8_0Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


QuantBlocks = Q4_1Blocks | Q8_0Blocks


def quantize_q4_1(weight: Tensor) -> Q4_1Blocks:
    """W float [out, in] on the Q4_1 grid: per block min and (max - min) / 15, both stored as
    fp16, and each code the nearest grid point of the stored (fp16) scale and min."""
    out_features, in_features = _check_rows(weight)
    groups = weight.detach().float().reshape(out_features, in_features // QK, QK)
    low = groups.amin(dim=-1).half()  # [out, nb]
    scale = ((groups.amax(dim=-1) - low.float()) / 15.0).half()  # [out, nb]
    inv = torch.where(scale != 0, 1.0 / scale.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round((groups - low.float()[..., None]) * inv[..., None]).clamp(0, 15)
    q = q.to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)  # [out, nb, 16]
    return Q4_1Blocks(codes.contiguous(), scale.contiguous(), low.contiguous())


def quantize_q8_0(weight: Tensor) -> Q8_0Blocks:
    """W float [out, in] on the Q8_0 grid: per block max|w| / 127 stored as fp16, codes the
    nearest multiple of the stored scale (|q| <= 127)."""
    out_features, in_features = _check_rows(weight)
    groups = weight.detach().float().reshape(out_features, in_features // QK, QK)
    scale = (groups.abs().amax(dim=-1) / 127.0).half()  # [out, nb]
    inv = torch.where(scale != 0, 1.0 / scale.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round(groups * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return Q8_0Blocks(q.contiguous(), scale.contiguous())
