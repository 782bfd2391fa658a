"""Read a Llama-family Hugging Face folder: config.json, *.safetensors and tokenizer.json.

Weights come back under `engine.model`'s canonical names as float32 [out, in] tensors. HF
checkpoints keep Q/K rows in the split-half rotary layout, so the config says
`rope_layout="half"`. The tokenizer must be a byte-level BPE `tokenizer.json`; the chat template
comes from `chat_template.jinja` or `tokenizer_config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file

from engine.model_config import ModelConfig
from engine.tokenizer import TokenizerSpec

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


class HFFolderContents(NamedTuple):
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerSpec


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def read_config(raw: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig from a Llama-family config.json."""
    model_type = raw.get("model_type")
    if model_type != "llama":
        raise ValueError(f"unsupported model_type {model_type!r} (only 'llama')")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("Llama checkpoints with projection biases are not supported")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(raw),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_layout="half",
        name=name,
    )


def canonical_name(hf_name: str) -> str | None:
    """Canonical weight name for a HF Llama tensor name (None for unused tensors)."""
    stem = hf_name.removesuffix(".weight")
    if stem in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[stem]
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"layers.{int(parts[2])}.{_LAYER_NAMES[parts[3]]}"
    return None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Canonical-named float32 weights from every *.safetensors file in `folder`."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for hf_name, tensor in load_file(str(file)).items():
            if hf_name.endswith(".bias"):
                raise ValueError(f"unexpected bias tensor {hf_name!r} in {file.name}")
            name = canonical_name(hf_name)
            if name is not None:
                weights[name] = tensor.float()
    return weights


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    def byte_level(p: dict[str, Any]) -> bool:
        return p.get("type") == "ByteLevel" and p.get("use_regex", True)

    if pre and byte_level(pre):
        return "gpt2"
    steps = (pre or {}).get("pretokenizers") or []
    if (
        len(steps) == 2
        and steps[0].get("type") == "Digits"
        and steps[0].get("individual_digits")
        and byte_level(steps[1])
    ):
        return "smollm"
    raise ValueError(f"unsupported tokenizer.json pre_tokenizer: {json.dumps(pre)[:200]}")


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    return template if isinstance(template, str) else None


def _token_id(token: Any, vocab: dict[str, int]) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None


def read_tokenizer(folder: Path, name: str) -> TokenizerSpec:
    """TokenizerSpec from tokenizer.json (byte-level BPE) and tokenizer_config.json."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json")
    data = _read_json(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"unsupported tokenizer model {model.get('type')!r} (only BPE)")
    vocab: dict[str, int] = dict(model["vocab"])
    special: set[int] = set()
    for added in data.get("added_tokens") or []:
        vocab[added["content"]] = int(added["id"])
        special.add(int(added["id"]))
    tokens = [""] * (max(vocab.values()) + 1)
    for token, tid in vocab.items():
        tokens[tid] = token
    if "" in tokens:
        raise ValueError(f"tokenizer.json token ids are not contiguous (id {tokens.index('')})")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    config_path = folder / "tokenizer_config.json"
    tok_config = _read_json(config_path) if config_path.is_file() else {}
    return TokenizerSpec(
        tokens=tokens,
        special=frozenset(special),
        merges=merges,
        pre_tokenizer=_pre_tokenizer_name(data.get("pre_tokenizer")),
        chat_template=_chat_template(folder, tok_config),
        bos_token_id=_token_id(tok_config.get("bos_token"), vocab),
        eos_token_id=_token_id(tok_config.get("eos_token"), vocab),
        name=name,
    )


def read_hf_folder(folder: str | Path) -> HFFolderContents:
    """Config, float32 weights and tokenizer spec of a HF Llama folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    config = read_config(_read_json(config_path), folder.name)
    tokenizer = read_tokenizer(folder, folder.name)
    if len(tokenizer.tokens) > config.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer.tokens)} tokens, the model only {config.vocab_size}"
        )
    return HFFolderContents(config, read_weights(folder), tokenizer)
