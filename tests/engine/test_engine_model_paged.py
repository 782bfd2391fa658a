"""The paged model (kernels store_kv + paged attention) against the dense reference forward.

Sequences get random, interleaved page tables; their prompts are prefilled in chunks with several
sequences in one ragged step, then the rest is decoded one token per step for all of them at
once. Every position's logits must equal the dense, non-paged forward of the same weights.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.dense_reference import dense_logits, greedy_generate
from engine.loader import LoadedModel
from engine.model import LlamaModel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

PAGE_SIZE = 16
LOGITS_ATOL = 2e-3  # float32 paged vs dense; observed ~1e-4 on logits of magnitude ~30


class PagedSequences:
    """KV pages for a few sequences, each with its own randomly chosen (shuffled) pages."""

    def __init__(self, model: LlamaModel, lengths: list[int], seed: int) -> None:
        c = model.config
        need = [-(-n // PAGE_SIZE) for n in lengths]
        num_pages = sum(need) + 3
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
        self.model = model
        self.tables: list[torch.Tensor] = []
        start = 0
        for n in need:
            self.tables.append(order[start : start + n].to(torch.int32))
            start += n
        shape = (num_pages, PAGE_SIZE, c.num_kv_heads, c.head_dim)
        garbage = torch.Generator().manual_seed(seed)  # stale finite values in unused slots
        self.k = [torch.randn(shape, generator=garbage) * 50 for _ in range(c.num_layers)]
        self.v = [torch.randn(shape, generator=garbage) * 50 for _ in range(c.num_layers)]

    def step(self, work: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """Run (seq, new token ids, start position) items as one step; logits per item."""
        ids, positions, slots, cu, lens = [], [], [], [0], []
        for seq, tokens, start in work:
            pos = torch.arange(start, start + len(tokens))
            table = self.tables[seq].long()
            ids += tokens
            positions.append(pos)
            slots.append(table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
            cu.append(cu[-1] + len(tokens))
            lens.append(start + len(tokens))
        width = max(len(self.tables[s]) for s, _, _ in work) + 2
        block_table = torch.full((len(work), width), 10_000, dtype=torch.int32)  # junk padding
        for row, (seq, _, _) in enumerate(work):
            block_table[row, : len(self.tables[seq])] = self.tables[seq]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            block_table=block_table,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            is_decode=all(len(t) == 1 for _, t, _ in work),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.cat(positions), meta, self.k, self.v)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(t) for _, t, _ in work]))


def _chunks(n: int, rng: random.Random) -> list[tuple[int, int]]:
    bounds, at = [], 0
    while at < n:
        size = rng.randint(1, 23)
        bounds.append((at, min(n, at + size)))
        at += size
    return bounds


def test_chunked_prefill_and_batched_decode_equal_dense(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    texts = [
        "The quick brown fox jumps over the lazy dog while 12345 geese watch.",
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
        "Paris is the capital of France. Berlin is the capital of",
    ]
    seqs = [tok.encode(t) for t in texts]
    decode_tail = 5
    rng = random.Random(0)
    paged = PagedSequences(loaded_model.model, [len(s) for s in seqs], seed=1)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    prefill = [_chunks(len(s) - decode_tail, rng) for s in seqs]
    for step in range(max(len(p) for p in prefill)):  # ragged prefill, sequences share steps
        work = [(i, seqs[i][a:b], a) for i, p in enumerate(prefill) if step < len(p)
                for a, b in [p[step]]]
        for (i, _, _), logits in zip(work, paged.step(work), strict=True):
            got[i].append(logits)
    for t in range(decode_tail):  # batched decode
        work = [(i, [s[len(s) - decode_tail + t]], len(s) - decode_tail + t)
                for i, s in enumerate(seqs)]
        for (i, _, _), logits in zip(work, paged.step(work), strict=True):
            got[i].append(logits)
    for i, s in enumerate(seqs):
        expected = dense_logits(loaded_model.model, s)
        torch.testing.assert_close(torch.cat(got[i]), expected, atol=LOGITS_ATOL, rtol=0)


def test_greedy_paged_equals_dense_and_answers_paris(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    question = {"role": "user", "content": "What is the capital of France?"}
    prompt = tok.apply_chat_template([question])
    max_new = 12
    paged = PagedSequences(loaded_model.model, [len(prompt) + max_new], seed=2)
    tokens = [int(paged.step([(0, prompt, 0)])[0][-1].argmax())]
    while len(tokens) < max_new and tokens[-1] not in tok.stop_token_ids:
        logits = paged.step([(0, tokens[-1:], len(prompt) + len(tokens) - 1)])[0]
        tokens.append(int(logits[-1].argmax()))
    reference = greedy_generate(loaded_model.model, prompt, max_new, tok.stop_token_ids)
    assert tokens == reference
    assert "Paris" in tok.decode(tokens)
