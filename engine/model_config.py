"""Hyper-parameters of a Llama-family decoder, shared by the model, loader and runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeLayout = Literal["interleaved", "half"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family model.

    `rope_layout` says how the Q/K projection rows pair up for rotary embedding: GGUF files store
    them permuted for the interleaved-pair layout ("interleaved"); Hugging Face checkpoints use the
    split-half layout ("half").
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    rope_layout: RopeLayout
    name: str

    def __post_init__(self) -> None:
        positive = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position": self.max_position,
        }
        for field, value in positive.items():
            if value <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError("rope_theta and rms_eps must be positive")
        if self.rope_layout not in ("interleaved", "half"):
            raise ValueError(
                f"rope_layout must be 'interleaved' or 'half', got {self.rope_layout!r}"
            )

    @property
    def q_size(self) -> int:
        """Width of the query projection output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim
