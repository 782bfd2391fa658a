"""Read a llama.cpp GGUF file: hyper-parameters, dequantised weights and the tokenizer.

Weights come back under the canonical names `engine.model` expects, as float32 tensors in
torch's [out_features, in_features] order (GGUF lists dims innermost-first, i.e. the reverse of
the numpy shape `gguf.quants.dequantize` returns). Q/K rows stay as GGUF stores them (permuted
for the interleaved-pair rotary layout), so the config says `rope_layout="interleaved"`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.gguf_file import GGUFFile, TensorInfo
from engine.model_config import ModelConfig
from engine.quant_blocks import Q4_1Blocks, Q8_0Blocks, QuantBlocks
from engine.tokenizer import TokenizerSpec

CONTROL_TOKEN = 3  # llama.cpp token type
USER_DEFINED_TOKEN = 4

_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
_GLOBAL_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}


class GGUFContents(NamedTuple):
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerSpec


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, number or list), or `default` when absent."""
    return reader.metadata.get(key, default)


def _require(reader: GGUFFile, key: str) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return value


def read_config(reader: GGUFFile, name: str) -> ModelConfig:
    """ModelConfig from the `<arch>.*` metadata keys (Llama-family architectures)."""
    arch = _require(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    hidden = int(_require(reader, "llama.embedding_length"))
    heads = int(_require(reader, "llama.attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = field_value(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(_require(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, "llama.feed_forward_length")),
        num_layers=int(_require(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(field_value(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(field_value(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(field_value(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_require(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position=int(_require(reader, "llama.context_length")),
        tie_embeddings="output.weight" not in tensor_names,
        rope_layout="interleaved",
        name=name,
    )


def _dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of 32: fp16 scale d, 32 int8 q; value = d * q."""
    blocks = data.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [N, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [N, 32]
    return (q * d).reshape(data.shape[0], -1)


def _dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_1 blocks of 32: fp16 scale d, fp16 min m, 16 bytes of nibbles (low nibbles are
    elements 0-15, high nibbles 16-31); value = d * q + m."""
    blocks = data.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [N, 1]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [N, 1]
    packed = blocks[:, 4:]  # [N, 16]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)  # [N, 32]
    return (q * d + m).reshape(data.shape[0], -1)


_FAST_DEQUANT = {
    GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    GGMLQuantizationType.Q4_1: _dequantize_q4_1,
}


def dequantize_tensor(tensor: TensorInfo) -> np.ndarray:
    """float32 [rows, row elements] values of a GGUF tensor (vectorised for Q8_0 and Q4_1,
    `gguf.quants.dequantize` for every other type)."""
    fast = _FAST_DEQUANT.get(tensor.qtype)
    if fast is not None:
        return fast(tensor.data)
    return dequantize(tensor.data, tensor.qtype)


def canonical_name(gguf_name: str) -> str | None:
    """Canonical weight name for a GGUF tensor name (None for tensors the model does not use)."""
    stem = gguf_name.removesuffix(".weight")
    if stem in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[stem]
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None


def iter_weights(reader: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, float32 tensor [out, in] or [n]) for every tensor the model uses."""
    for tensor in reader.tensors:
        name = canonical_name(tensor.name)
        if name is None:
            continue
        array = dequantize_tensor(tensor).reshape(tensor.shape)
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, dtype=np.float32, order="C")  # own a writable copy
        yield name, torch.from_numpy(array)


_BLOCK_TYPES: dict[GGMLQuantizationType, type[QuantBlocks]] = {
    GGMLQuantizationType.Q4_1: Q4_1Blocks,
    GGMLQuantizationType.Q8_0: Q8_0Blocks,
}


def read_gguf_blocks(path: str | Path) -> dict[str, QuantBlocks]:
    """The Q4_1 and Q8_0 matrices of a GGUF file as their blocks, bytes as stored (no
    dequantisation), under canonical names: what the native int4/int8 kernels compute with."""
    blocks: dict[str, QuantBlocks] = {}
    for tensor in GGUFFile(path).tensors:
        name, kind = canonical_name(tensor.name), _BLOCK_TYPES.get(tensor.qtype)
        if name is not None and kind is not None and len(tensor.dims) == 2:
            blocks[name] = kind.from_gguf(tensor.data)
    return blocks


def read_tokenizer(reader: GGUFFile, name: str) -> TokenizerSpec:
    """TokenizerSpec from `tokenizer.ggml.*` (byte-level BPE vocabularies only)."""
    model = _require(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only byte-level 'gpt2')")
    tokens = list(_require(reader, "tokenizer.ggml.tokens"))
    types = list(field_value(reader, "tokenizer.ggml.token_type", []))
    special = frozenset(
        i for i, t in enumerate(types) if t in (CONTROL_TOKEN, USER_DEFINED_TOKEN)
    )
    return TokenizerSpec(
        tokens=tokens,
        special=special,
        merges=list(_require(reader, "tokenizer.ggml.merges")),
        pre_tokenizer=str(field_value(reader, "tokenizer.ggml.pre", "gpt2")),
        chat_template=field_value(reader, "tokenizer.chat_template"),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
        name=name,
    )


def read_gguf(path: str | Path) -> GGUFContents:
    """Config, dequantised float32 weights and tokenizer spec of a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = GGUFFile(path)
    name = str(field_value(reader, "general.name", path.stem))
    return GGUFContents(
        config=read_config(reader, name),
        weights=dict(iter_weights(reader)),
        tokenizer=read_tokenizer(reader, name),
    )
