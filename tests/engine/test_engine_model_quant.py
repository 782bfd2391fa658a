"""fp16 weight storage (fbgemm) against the float32 reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from engine.attention_metadata import AttentionMetadata
from engine.linear import DenseLinear, Fp16DynamicLinear, quantize_linear
from engine.loader import LoadedModel
from engine.model import LlamaModel

FP16_LOGITS_ATOL = 0.1  # observed max |diff| ~0.03 against fp32 on logits of magnitude ~30


def test_fp16_linear_equals_linear_with_fp16_rounded_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    layer = quantize_linear(w, "fp16")
    assert isinstance(layer, Fp16DynamicLinear)
    expected = F.linear(x, w.half().float())
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(layer.dequantized(), w.half().float())
    dense_bytes = DenseLinear(48, 40, torch.float32).weight_bytes()
    assert layer.weight_bytes() == 2 * 48 * 40 == dense_bytes // 2


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linear(torch.zeros(4, 4), "int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32"):
        quantize_linear(torch.zeros(4, 4, dtype=torch.bfloat16), "fp16")


def _paged_greedy(
    model: LlamaModel, prompt: list[int], steps: int
) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits [L, vocab] and `steps` greedy tokens through the paged path."""
    c = model.config
    pages = -(-(len(prompt) + steps) // 16)
    k = [torch.zeros(pages, 16, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
    v = [torch.zeros_like(t) for t in k]
    table = torch.arange(pages, dtype=torch.int32)[None]

    def run(ids: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(ids))
        meta = AttentionMetadata(
            slot_mapping=pos,
            block_table=table,
            cu_seqlens_q=torch.tensor([0, len(ids)], dtype=torch.int32),
            seq_lens=torch.tensor([start + len(ids)], dtype=torch.int32),
            is_decode=len(ids) == 1,
        )
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(ids), pos, meta, k, v))

    prefill = run(prompt, 0)
    tokens = [int(prefill[-1].argmax())]
    for i in range(steps - 1):
        tokens.append(int(run(tokens[-1:], len(prompt) + i)[-1].argmax()))
    return prefill, tokens


@pytest.mark.slow
@pytest.mark.usefixtures("torch_single_thread")
def test_fp16_model_stays_close_to_fp32(loaded_model: LoadedModel) -> None:
    fp16 = copy.deepcopy(loaded_model.model)
    fp16.quantize("fp16")
    assert fp16.streamed_weight_bytes() < 0.55 * loaded_model.model.streamed_weight_bytes()
    tok = loaded_model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}])
    fp16_logits, fp16_tokens = _paged_greedy(fp16, prompt, 6)
    fp32_logits, fp32_tokens = _paged_greedy(loaded_model.model, prompt, 6)
    torch.testing.assert_close(fp16_logits, fp32_logits, atol=FP16_LOGITS_ATOL, rtol=0)
    assert fp16_tokens == fp32_tokens
    with pytest.raises(ValueError, match="unquantised"):
        fp16.quantize("fp16")
