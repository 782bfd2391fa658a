"""Per-step description of where the new tokens live in the paged KV cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import paged_kernels


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache. T = total new tokens, B = sequences.

    `plan` is the step's `paged_kernels.AttentionPlan` for exactly these tensors: their values
    checked once and the backend's read plan derived once, then reused by every layer. `planned`
    builds it; a metadata without one gets it from the model at the start of the step.
    """

    # [T] int64: page * page_size + offset for each new token (-1 = skip)
    slot_mapping: torch.Tensor
    block_table: torch.Tensor  # [B, max_pages] int32 page ids per sequence (padding arbitrary)
    cu_seqlens_q: torch.Tensor  # [B+1] int32: new tokens of sequence b are rows cu[b]:cu[b+1]
    seq_lens: torch.Tensor  # [B] int32: total tokens of each sequence incl. the new ones
    is_decode: bool  # every sequence has exactly one new token (use paged_decode_attention)
    plan: paged_kernels.AttentionPlan | None = None

    def planned(
        self,
        k_cache: torch.Tensor,
        backend: str | None = None,
        max_new_tokens: int | None = None,
    ) -> AttentionMetadata:
        """This metadata with its plan for caches shaped like `k_cache` on `backend`
        (None: by device). `max_new_tokens`: the longest chunk, when known on the host."""
        plan = paged_kernels.plan_attention(
            self.block_table, self.seq_lens, self.cu_seqlens_q, self.slot_mapping, k_cache,
            is_decode=self.is_decode, backend=backend, max_new_tokens=max_new_tokens,
        )  # fmt: skip
        return dataclasses.replace(self, plan=plan)
