"""`ModelRunner`: turns a scheduled step into model inputs, runs the model, returns logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

import kernels
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
    """Owns the paged KV cache and runs the model over one step's ragged batch.

    `kernel_backend` ("auto", "torch", "triton") is checked against the cache's device here, so
    an impossible choice (Triton on CPU without TRITON_INTERPRET=1) fails at construction.
    Each step's metadata carries its kernel plan, built once in `prepare`. On CUDA the step's
    index tensors travel from pinned host memory without blocking, so a step issues no host
    sync before its logits are read.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_pages: int,
        page_size: int,
        device: str,
        kernel_backend: str = "auto",
    ) -> None:
        self.model = loaded.model
        self.page_size = page_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.model.quantization != "none":
            raise ValueError(
                f"the model's {self.model.quantization!r} weights are a CPU format; load it "
                "with quantization='none' and dtype float16 or bfloat16 for CUDA"
            )
        dtype = self.model.embed.dtype  # the model dtype (quantised weights keep fp32 activations)
        self.kv_cache = KVCache(loaded.config, num_pages, page_size, dtype, self.device)
        requested = None if kernel_backend == "auto" else kernel_backend
        first_cache = self.kv_cache.k[0]
        self.kernel_backend: kernels.Backend = kernels.resolve_backend(requested, first_cache)

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        """Host values -> a tensor on the runner's device (pinned, non-blocking on CUDA)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype)
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

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
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_table=self._tensor(table, torch.int32),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            is_decode=all(n == 1 for _, n in batch),
        ).planned(self.kv_cache.k[0], self.kernel_backend, max(n for _, n in batch))
        rows = self._tensor([cu[i + 1] - 1 for i in sampling], torch.int64)
        return StepInputs(
            input_ids=self._tensor(ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            logit_rows=rows,
            sampling=sampling,
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step; -> logits [N, vocab] float32 for the sampling sequences only."""
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache.k, self.kv_cache.v,
            self.kernel_backend,
        )  # [T, hidden]
        if not inputs.sampling:
            return torch.empty(0, 0)
        return self.model.compute_logits(hidden[inputs.logit_rows])  # [N, vocab]
