"""GGUF parsing and dequantisation against the `gguf` package's own reader and dequantiser."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from engine.gguf import canonical_name, dequantize_tensor, read_config
from engine.gguf_file import GGUFFile
from engine.loader import default_model_path
from engine.model_config import ModelConfig

pytestmark = pytest.mark.slow

Pair = tuple[GGUFFile, gguf.GGUFReader]


@pytest.fixture(scope="module")
def gguf_pair() -> Pair:
    path = default_model_path()
    return GGUFFile(path), gguf.GGUFReader(str(path))


def test_metadata_and_tensors_equal_gguf_reader(gguf_pair: Pair) -> None:
    ours, reference = gguf_pair
    for key, field in reference.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.qtype) == (theirs.name, theirs.tensor_type)
        assert mine.dims == tuple(int(d) for d in theirs.shape)
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name


def test_fast_dequantisation_equals_gguf_quants(gguf_pair: Pair) -> None:
    ours, _ = gguf_pair
    seen: set[gguf.GGMLQuantizationType] = set()
    for tensor in ours.tensors:  # one tensor of every type, and every tensor of one block
        if tensor.qtype in seen and not tensor.name.startswith("blk.7."):
            continue
        seen.add(tensor.qtype)
        expected = dequantize(tensor.data, tensor.qtype)
        np.testing.assert_array_equal(dequantize_tensor(tensor).reshape(expected.shape), expected)
    assert {t.name for t in gguf.GGMLQuantizationType if t in seen} >= {"Q4_1", "Q8_0", "F32"}


def test_config_from_metadata(gguf_pair: Pair) -> None:
    config = read_config(gguf_pair[0], "smollm2")
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30, 576, 9, 3
    )
    assert config.tie_embeddings and config.rope_layout == "interleaved"


def test_canonical_names() -> None:
    assert canonical_name("token_embd.weight") == "embed"
    assert canonical_name("output.weight") == "lm_head"
    assert canonical_name("blk.12.attn_q.weight") == "layers.12.q"
    assert canonical_name("blk.0.ffn_down.weight") == "layers.0.down"
    assert canonical_name("rope_freqs.weight") is None


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)


def _config(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=4, rope_theta=10000.0, rms_eps=1e-5, max_position=64,
        tie_embeddings=True, rope_layout="half", name="t",
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": 3}, "multiple"),
        ({"head_dim": 5}, "even"),
        ({"rope_layout": "split"}, "rope_layout"),
        ({"rms_eps": 0.0}, "positive"),
    ],
)
def test_model_config_rejects_bad_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**overrides)
    assert _config().q_size == 16 and _config().kv_size == 8
