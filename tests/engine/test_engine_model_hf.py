"""The engine's model (GGUF loaded and dequantised by us, paged path) against `transformers`.

transformers loads the same GGUF with its own dequantisation and un-permutes Q/K to the split-half
rotary layout; we keep GGUF's interleaved layout. Logits must agree within LOGITS_ATOL.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

LOGITS_ATOL = 1e-3  # float32 both sides; observed max |diff| ~5e-5 on logits of magnitude ~35
PROMPTS = [
    "Hello world, my name is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "日本の首都は東京です。 The year 2024 had 366 days because",
]


def _paged_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """All-position logits from one prefill step over a shuffled page table."""
    c = loaded.config
    page_size, pages = 16, -(-len(ids) // 16)
    table = torch.randperm(pages + 2, generator=torch.Generator().manual_seed(len(ids)))[:pages]
    positions = torch.arange(len(ids))
    meta = AttentionMetadata(
        slot_mapping=table[positions // page_size] * page_size + positions % page_size,
        block_table=table[None].to(torch.int32),
        cu_seqlens_q=torch.tensor([0, len(ids)], dtype=torch.int32),
        seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
        is_decode=False,
    )
    shape = (pages + 2, page_size, c.num_kv_heads, c.head_dim)
    k = [torch.zeros(shape) for _ in range(c.num_layers)]
    v = [torch.zeros(shape) for _ in range(c.num_layers)]
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), positions, meta, k, v))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(
    loaded_model: LoadedModel, hf_gguf_model: Any, prompt: str
) -> None:
    ids = loaded_model.tokenizer.encode(prompt)
    with torch.inference_mode():
        expected = hf_gguf_model(torch.tensor([ids])).logits[0].float()
    got = _paged_logits(loaded_model, ids)
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_config_matches_transformers(loaded_model: LoadedModel, hf_gguf_model: Any) -> None:
    hf, ours = hf_gguf_model.config, loaded_model.config
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size
    )
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads
    )
    assert ours.tie_embeddings and ours.rope_layout == "interleaved"
    assert ours.rms_eps == pytest.approx(hf.rms_norm_eps)
