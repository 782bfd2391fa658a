"""Quantize a loaded model with its checkpoint's own blocks where they are on the format's grid.

A Q4_1 GGUF under int4 keeps the file's bytes (the engine then computes with exactly llama.cpp's
weights); Q8_0 tensors (SmolLM2's tied embedding) become the int8 LM head as they are. Other
tensors are quantized from their float weights, like `LlamaModel.quantize` does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import Quantization
from engine.linear import quantize_linear
from engine.model import HEAD_QUANTIZATION, PROJECTIONS, LlamaModel
from engine.native import native_gemm
from engine.native_linear import HEAD_GRID, PROJECTION_GRID, blocks_linear
from engine.quant_blocks import Q4_1Blocks, Q8_0Blocks, QuantBlocks

# Canonical checkpoint names of each fused projection (see engine.model), in row order.
FUSED_SOURCES: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "o": ("o",),
    "gate_up": ("gate", "up"),
    "down": ("down",),
}


def fused_blocks(
    blocks: Mapping[str, QuantBlocks], layer: int, projection: str, grid: type[QuantBlocks]
) -> QuantBlocks | None:
    """A fused projection's blocks stacked from the checkpoint's, when every part is on `grid`."""
    parts = [blocks.get(f"layers.{layer}.{name}") for name in FUSED_SOURCES[projection]]
    if not all(isinstance(p, grid) for p in parts):
        return None
    if grid is Q4_1Blocks:
        return Q4_1Blocks.cat([p for p in parts if isinstance(p, Q4_1Blocks)])
    return Q8_0Blocks.cat([p for p in parts if isinstance(p, Q8_0Blocks)])


def quantize_with_checkpoint_blocks(
    model: LlamaModel, quantization: Quantization, blocks: Mapping[str, QuantBlocks]
) -> None:
    """`model.quantize(quantization)`, taking every projection whose checkpoint blocks are on
    the format's grid as they are (a Q4_1 GGUF under int4; Q8_0 tensors under int8 and for the
    LM head), and quantizing the rest from the float weights. Without the native library, or
    for other formats, it is `model.quantize` itself."""
    gemm = native_gemm()
    if gemm is None or quantization not in PROJECTION_GRID:
        model.quantize(quantization)
        return
    gemm = gemm.exact()  # the model's own products: float32 (decode steps: engine.native_step)
    if model.quantization != "none" or model.dtype != torch.float32:
        raise ValueError("quantize needs an unquantised float32 model")
    grid = PROJECTION_GRID[quantization]
    for i, layer in enumerate(model.blocks()):
        for name in PROJECTIONS:
            found = fused_blocks(blocks, i, name, grid)
            if found is None:  # not on the grid in the file: quantize the float weight
                projection = quantize_linear(getattr(layer, name).dequantized(), quantization)
            else:
                projection = blocks_linear(found, gemm)
            setattr(layer, name, projection)
    head = blocks.get("embed" if model.config.tie_embeddings else "lm_head")
    if isinstance(head, HEAD_GRID[quantization]):
        model.lm_head = blocks_linear(head, gemm)
    else:
        head_format = HEAD_QUANTIZATION[quantization]
        model.lm_head = quantize_linear(model.lm_head.dequantized(), head_format)
    model.quantization = quantization
