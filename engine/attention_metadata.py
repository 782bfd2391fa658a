"""Per-step description of where the new tokens live in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache. T = total new tokens, B = sequences."""

    # [T] int64: page * page_size + offset for each new token (-1 = skip)
    slot_mapping: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32 page ids per sequence (padding arbitrary)
    cu_seqlens_q: torch.Tensor  # [B+1] int32: new tokens of sequence b are rows cu[b]:cu[b+1]
    seq_lens: torch.Tensor  # [B] int32: total tokens of each sequence incl. the new ones
    is_decode: bool  # every sequence has exactly one new token (use paged_decode_attention)
