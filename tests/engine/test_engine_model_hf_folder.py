"""Loading a Llama-family Hugging Face folder (config.json + safetensors + tokenizer.json).

A tiny random `transformers` LlamaForCausalLM is saved with save_pretrained next to the GGUF's
tokenizer (saved by transformers, with SmolLM's digit-splitting pre-tokenizer restored); the
engine's model loaded from that folder must give the same logits as the transformers model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.loader import LoadedModel, load_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

LOGITS_ATOL = 1e-4  # float32 on both sides, same weights, tiny model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory, hf_gguf_tokenizer: Any) -> tuple[Path, Any]:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny_llama")
    config = transformers.LlamaConfig(
        vocab_size=len(hf_gguf_tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # non-trivial norms so a missed norm weight would show
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(folder)
    hf_gguf_tokenizer.save_pretrained(folder)
    tokenizer_json = folder / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    data["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True},
        ],
    }
    tokenizer_json.write_text(json.dumps(data), encoding="utf-8")
    return folder, model


def _prefill_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    c = loaded.config
    positions = torch.arange(len(ids))
    pages = -(-len(ids) // 8)
    table = torch.arange(pages, dtype=torch.int32).flip(0)  # pages in reverse order
    meta = AttentionMetadata(
        slot_mapping=table.long()[positions // 8] * 8 + positions % 8,
        block_table=table[None],
        cu_seqlens_q=torch.tensor([0, len(ids)], dtype=torch.int32),
        seq_lens=torch.tensor([len(ids)], dtype=torch.int32),
        is_decode=False,
    )
    k = [torch.zeros(pages, 8, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
    v = [torch.zeros_like(t) for t in k]
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), positions, meta, k, v))


def test_hf_folder_logits_match_transformers(
    hf_folder: tuple[Path, Any], loaded_model: LoadedModel
) -> None:
    folder, hf_model = hf_folder
    loaded = load_model(folder)
    assert loaded.config.rope_layout == "half" and not loaded.config.tie_embeddings
    assert loaded.config.rope_theta == 5000.0 and loaded.config.num_kv_heads == 2
    ids = loaded.tokenizer.encode("A tiny model: 42 tokens, give or take. 日本 👍")
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(loaded, ids), expected, atol=LOGITS_ATOL, rtol=0)


def test_hf_folder_tokenizer_equals_gguf_tokenizer(
    hf_folder: tuple[Path, Any], loaded_model: LoadedModel
) -> None:
    loaded = load_model(hf_folder[0])
    text = "Numbers 12345, code `x = [1, 2]`, CJK 東京, emoji 🚀 <|im_end|>"
    assert loaded.tokenizer.encode(text) == loaded_model.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.render_chat(messages) == loaded_model.tokenizer.render_chat(messages)
    assert loaded.tokenizer.stop_token_ids >= {2}


def test_bad_model_paths_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
