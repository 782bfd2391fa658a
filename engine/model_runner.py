"""`ModelRunner`: turns a scheduled step into model inputs, runs the model, returns logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

import paged_kernels
from engine.attention_metadata import AttentionMetadata
from engine.kv_cache import KVCache
from engine.loader import LoadedModel
from engine.native_step import NativeDecoder, native_decoder
from engine.scheduler import ScheduledSeq


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [R] int64: rows whose logits are computed: per sampling sequence its last new token, or
    # with a draft of k tokens its last k + 1 rows (the real token, then each draft token)
    logit_rows: torch.Tensor
    sampling: list[int]  # indices into the step's sequences that sample a token
    num_logits: list[int]  # per sampling sequence, its rows in logit_rows (1 + draft length)


class ModelRunner:
    """Owns the paged KV cache and runs the model over one step's ragged batch.

    `kernel_backend` ("auto", "torch", "triton") is checked against the cache's device here, so
    an impossible choice (Triton on CPU without TRITON_INTERPRET=1) fails at construction.
    Each step's metadata carries its kernel plan, built once in `prepare`; a decode step of a
    block-quantized CPU model runs in one native call instead (`engine.native_step`), which
    checks its own indices and needs no plan. On CUDA the step's
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
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = loaded.model
        self.page_size = page_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.model.quantization != "none":
            raise ValueError(
                f"the model's {self.model.quantization!r} weights are a CPU format; load it "
                "with quantization='none' and dtype float16 or bfloat16 for CUDA"
            )
        # the model dtype (quantised weights keep fp32 activations), unless a storage dtype is given
        dtype = kv_dtype or self.model.embed.dtype
        self.kv_cache = KVCache(loaded.config, num_pages, page_size, dtype, self.device)
        requested = None if kernel_backend == "auto" else kernel_backend
        first_cache = self.kv_cache.k[0]
        self.kernel_backend: paged_kernels.Backend = paged_kernels.resolve_backend(requested,
                                                                                   first_cache)
        # Decode steps of a block-quantized CPU model run in one native call (None otherwise).
        self.native_decoder: NativeDecoder | None = None
        if self.kernel_backend == "torch":
            self.native_decoder = native_decoder(self.model, self.kv_cache.k, self.kv_cache.v)

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        """Host values -> a tensor on the runner's device (pinned, non-blocking on CUDA)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype)
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    def prepare(self, batch: Seq[ScheduledSeq]) -> StepInputs:
        """Flatten the step: new tokens, positions, slots, page tables, who samples.

        A sequence with a speculative draft contributes its uncomputed token then the draft
        tokens, so the step is a short prefill for it (causal over the paged KV), and its
        last 1 + len(draft) rows get logits.
        """
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        sampling: list[int] = []
        num_logits: list[int] = []
        for index, (seq, n, draft) in enumerate(batch):
            start = seq.num_computed_tokens
            m = n + len(draft)
            ids.extend(seq.token_ids[start : start + n])
            ids.extend(draft)
            positions.extend(range(start, start + m))
            slots.extend(seq.pages[p // ps] * ps + p % ps for p in range(start, start + m))
            cu.append(cu[-1] + m)
            seq_lens.append(start + m)
            if start + n == seq.num_tokens:
                sampling.append(index)
                num_logits.append(1 + len(draft))
        width = max(len(s.seq.pages) for s in batch)
        table = [s.seq.pages + [0] * (width - len(s.seq.pages)) for s in batch]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_table=self._tensor(table, torch.int32),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            is_decode=all(s.num_step_tokens == 1 for s in batch),
        )
        native = self.native_decoder
        if native is None or not native.accepts(meta, len(ids)):  # the native step checks its own
            longest = max(s.num_step_tokens for s in batch)
            meta = meta.planned(self.kv_cache.k[0], self.kernel_backend, longest)
        pairs = zip(sampling, num_logits, strict=True)
        row_ids = [r for i, k in pairs for r in range(cu[i + 1] - k, cu[i + 1])]
        return StepInputs(
            input_ids=self._tensor(ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            logit_rows=self._tensor(row_ids, torch.int64),
            sampling=sampling,
            num_logits=num_logits,
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Run the step; -> logits [R, vocab] float32 of `inputs.logit_rows` only."""
        native = self.native_decoder
        if native is not None and native.accepts(inputs.meta, inputs.input_ids.shape[0]):
            hidden = native(inputs.input_ids, inputs.positions, inputs.meta)  # [T, hidden]
            head = native.logits
        else:
            hidden = self.model(
                inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache.k,
                self.kv_cache.v, self.kernel_backend,
            )  # fmt: skip
            head = self.model.compute_logits
        if not inputs.sampling:
            return torch.empty(0, 0)
        return head(hidden[inputs.logit_rows])  # [N, vocab]
