"""`ModelRunner`: turns a scheduled step into model inputs, runs the model, returns logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from engine.attention_metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.loader import LoadedModel
from engine.scheduler import ScheduledSeq


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [N] int64: row of the last new token of each sampling sequence
    sampling: list[int]  # indices into the step's sequences that sample a token


class ModelRunner:
    """Owns the paged KV cache and runs the model over one step's ragged batch."""

    def __init__(self, loaded: LoadedModel, num_pages: int, page_size: int, device: str) -> None:
        self.model = loaded.model
        self.page_size = page_size
        self.device = torch.device(device)
        dtype = self.model.embed.dtype  # the model dtype (quantised weights keep fp32 activations)
        self.kv_cache = KVCache(loaded.config, num_pages, page_size, dtype, self.device)

    def prepare(self, batch: Seq[ScheduledSeq]) -> StepInputs:
        """Flatten the step: new tokens, positions, slots, page tables, who samples."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        sampling: list[int] = []
        for index, (seq, n) in enumerate(batch):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(seq.pages[p // ps] * ps + p % ps for p in range(start, start + n))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                sampling.append(index)
        width = max(len(s.pages) for s, _ in batch)
        table = [s.pages + [0] * (width - len(s.pages)) for s, _ in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            is_decode=all(n == 1 for _, n in batch),
        )
        rows = torch.tensor([cu[i + 1] - 1 for i in sampling], dtype=torch.int64, device=dev)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logit_rows=rows,
            sampling=sampling,
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step; -> logits [N, vocab] float32 for the sampling sequences only."""
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache.k, self.kv_cache.v
        )  # [T, hidden]
        if not inputs.sampling:
            return torch.empty(0, 0)
        return self.model.compute_logits(hidden[inputs.logit_rows])  # [N, vocab]
