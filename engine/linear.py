"""Linear projections y = x @ W.T in the weight storage formats the CPU decode path can use.

- `DenseLinear`: W in the model dtype (the float32 correctness reference; the CUDA path).
- `Fp16DynamicLinear`: W stored as fp16, computed in fp32 (fbgemm `linear_dynamic_fp16`): half
  the weight bytes of fp32, logits within ~0.03 of the fp32 model on SmolLM2-135M.
- int8 / int4: `quantize_linear` picks the native block-quantized kernels
  (`engine.native_linear`: GGUF's Q8_0 / Q4_1 grids, int16 activations, AVX2) and falls back to
  torch's kernels below when the native library cannot be built (one warning in the log):
- `Int8WeightLinear`: W int8 with one symmetric scale per output channel, on torch's
  `_weight_int8pack_mm` (a quarter of fp32's bytes).
- `Int4WeightLinear`: W 4-bit with a scale and a zero point per group of 32 inputs (the grid of
  GGUF's Q4_1), on torch's `_weight_int4pack_mm_for_cpu` (an eighth of fp32's bytes plus scales).

torch's int8/int4 CPU kernels are vectorised for bfloat16 activations only (float32 activations
take a scalar path ~10x slower on AVX2), so those modules round x to bfloat16, and their
output is bfloat16 returned as float32. On an AVX2 machine without AVX512 they do not beat the
fbgemm fp16 path (see benchmarks/bench_engine.py); the native kernels do.
Measured and rejected: bf16 weights (no AVX512-BF16: ~2x slower than fp32), fbgemm dynamic int8
(per-tensor int8 activations: logit errors up to ~15; deprecated quantized-tensor API), and
`torch.compile` of a dequantise-then-matmul (Inductor's CPU GEMV: ~10x slower than fp16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import QUANTIZATIONS as QUANTIZATIONS  # re-exported: older imports
from engine.config import Quantization as Quantization
from engine.linear_base import Linear as Linear  # re-exported: the interface lives there
from engine.linear_base import PackedLinear as PackedLinear
from engine.native_linear import native_linear

INT4_GROUP_SIZE = 32
_ACT_DTYPE = torch.bfloat16  # what torch's int8/int4 CPU kernels have a fast path for


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


class Fp16DynamicLinear(PackedLinear):
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


class Int8WeightLinear(PackedLinear):
    """W int8 [out, in], symmetric per output channel: W ~= q * scale[out], |q| <= 127."""

    def __init__(self, weight: Tensor) -> None:  # weight [out, in] float32
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        # Plain attributes, not buffers: these formats never leave the CPU (see EngineConfig).
        self.qweight: Tensor = q  # [out, in] int8
        self.scales: Tensor = scale.to(_ACT_DTYPE)  # [out]

    def forward(self, x: Tensor) -> Tensor:  # [T, in] float32 -> [T, out] float32
        y = torch._weight_int8pack_mm(x.to(_ACT_DTYPE), self.qweight, self.scales)
        return y.float()

    def dequantized(self) -> Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()


class Int4WeightLinear(PackedLinear):
    """W 4-bit [out, in] in groups of `group_size` inputs: W ~= scale * q + low per group,
    q in 0..15 (asymmetric min/max, like GGUF's Q4_1), packed by torch for its CPU kernel."""

    def __init__(self, weight: Tensor, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        w = weight.detach().float()
        out_features, in_features = w.shape
        if in_features % group_size:
            raise ValueError(
                f"int4 needs in_features divisible by {group_size}, got {in_features}"
            )
        rows = -(-out_features // 16) * 16  # torch packs rows in blocks of 16: pad with zeros
        w = F.pad(w, (0, 0, 0, rows - out_features))
        groups = w.reshape(rows, in_features // group_size, group_size)
        low = groups.amin(dim=-1)  # [out, G]
        scale = ((groups.amax(dim=-1) - low) / 15.0).clamp(min=1e-12)  # [out, G]
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        q = q.to(torch.int32).reshape(rows, in_features)
        # torch's kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale.
        scales_zeros = torch.stack([scale, low + 8.0 * scale], dim=-1)  # [out, G, 2]
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self.packed: Tensor = packed
        self.scales_zeros: Tensor = scales_zeros.transpose(0, 1).contiguous().to(_ACT_DTYPE)
        # [G, rows, 2]
        self.group_size = group_size
        self._shape = (out_features, in_features)

    def forward(self, x: Tensor) -> Tensor:  # [T, in] float32 -> [T, out] float32
        y = torch._weight_int4pack_mm_for_cpu(
            x.to(_ACT_DTYPE), self.packed, self.group_size, self.scales_zeros
        )  # [T, rows]
        return y[:, : self._shape[0]].float()

    def dequantized(self) -> Tensor:
        """W as the kernel applies it (each entry rounded to bfloat16): rows of I @ W.T."""
        eye = torch.eye(self._shape[1], device=self.packed.device)
        return self.forward(eye).t().contiguous()

    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


def quantize_linear(weight: Tensor, quantization: Quantization) -> PackedLinear:
    """A quantised projection module for W [out, in] (float32 weights only)."""
    if weight.dtype != torch.float32:
        raise ValueError(f"quantization needs float32 weights, got {weight.dtype}")
    if weight.device.type != "cpu":
        raise ValueError(f"quantized weights run on CPU only, got a {weight.device} weight")
    if quantization == "fp16":
        return Fp16DynamicLinear(weight)
    if quantization in ("int8", "int4"):
        native = native_linear(weight, quantization)
        if native is not None:
            return native
    if quantization == "int8":
        return Int8WeightLinear(weight)
    if quantization == "int4":
        return Int4WeightLinear(weight)
    raise ValueError(f"unknown quantization {quantization!r}; choose from {QUANTIZATIONS}")
