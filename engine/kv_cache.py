"""The paged KV cache tensors: per layer, K and V of shape [num_pages, page_size, Hkv, D]."""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig


class KVCache:
    """Owns the K and V page tensors of every layer; page ids index dimension 0.

    Pages are zero-initialised so a kernel that reads a page's unused tail never meets NaNs.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
