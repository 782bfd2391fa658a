"""Validation of SamplingParams / EngineConfig, the streaming detokenizer, the memory plan."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.gguf_file import GGUFFile
from engine.loader import default_model_path
from engine.plan import (
    ModelShape,
    kv_bytes_per_token,
    main,
    pages_for_budget,
    parse_count,
    parse_size,
    plan_memory,
)
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"seed": -1}, "seed"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logit_bias": {3: "up"}}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
        ({"logit_bias": 5}, "logit_bias"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_logit_bias() -> None:
    """A mapping or pairs become (token id, bias) pairs in id order (hashable, like the rest)."""
    params = SamplingParams(logit_bias={5: 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (5, 1.0)) == params.biases
    assert SamplingParams(logit_bias=[(5, 1.0), (2, -3.5)]) == params
    assert hash(params) == hash(SamplingParams(logit_bias={2: -3.5, 5: 1.0}))
    assert SamplingParams().biases == ()


def test_sampling_params_normalise_stop() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": 12}, "power of two"),
        ({"num_pages": -1}, "num_pages"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"dtype": "int3"}, "dtype"),
        ({"num_pages": 4, "memory_budget_bytes": 1 << 30}, "num_pages or memory_budget_bytes"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
        ({"kv_cache_dtype": "float16", "device": "cuda"}, "kv_cache_dtype='auto'"),
        ({"kv_cache_dtype": "float16", "dtype": "bfloat16"}, "CPU option for float32"),
    ],
)
def test_bad_engine_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def byte_pieces(i: int) -> bytes:
    return bytes([i])


def stream_text(detok: IncrementalDetokenizer, data: bytes) -> list[str]:
    deltas = []
    for b in data:
        if detok.stopped:
            break
        detok.add(b)
        deltas.append(detok.delta())
    detok.flush()
    deltas.append(detok.delta(final=True))
    return deltas


def test_deltas_never_split_a_utf8_character() -> None:
    text = "héllo 世界 🙂!"
    deltas = stream_text(IncrementalDetokenizer(byte_pieces), text.encode())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "世" in deltas  # the 3-byte character arrives whole, in one delta


def test_stop_string_is_cut_and_never_leaks_partially() -> None:
    detok = IncrementalDetokenizer(byte_pieces, stop=("STOP",))
    deltas = stream_text(detok, b"abc STandSTOP tail")
    assert detok.stopped
    assert detok.text == "abc STand"
    assert "".join(deltas) == "abc STand"
    for i in range(len(deltas)):  # no prefix of the stream ever showed an 'STO'
        assert "STO" not in "".join(deltas[: i + 1])


def test_stop_string_kept_when_asked_and_earliest_stop_wins() -> None:
    detok = IncrementalDetokenizer(byte_pieces, stop=("yz", "x"), include_stop=True)
    stream_text(detok, b"abxyz")
    assert detok.text == "abx"
    assert detok.stop_string == "x"  # which stop string ended the text


def test_stop_string_names_the_match_and_stays_none_without_one() -> None:
    detok = IncrementalDetokenizer(byte_pieces, stop=("zz", "4,"))
    stream_text(detok, b"1, 2, 3, 4, 5")
    assert (detok.text, detok.stop_string) == ("1, 2, 3, ", "4,")
    free = IncrementalDetokenizer(byte_pieces, stop=("zz",))
    stream_text(free, b"1, 2")
    assert not free.stopped and free.stop_string is None


CALL = '<tool_call>\n{"name": "f", "arguments": {"q": "a\\nb"}}\n</tool_call>'


def test_stop_strings_end_free_text_but_never_cut_the_shaped_output_after_it() -> None:
    # the same stop strings, with and without the marker of where free text ends
    cut = IncrementalDetokenizer(byte_pieces, stop=('"', "\n"))
    stream_text(cut, f"Sure{CALL}".encode())
    assert (cut.text, cut.stop_string) == ("Sure<tool_call>", "\n")  # the call is cut open
    kept = IncrementalDetokenizer(byte_pieces, stop=('"', "\n"), free_text_until="<tool_call>")
    deltas = stream_text(kept, f"Sure{CALL}".encode())
    assert not kept.stopped and kept.text == f"Sure{CALL}" == "".join(deltas)
    # a stop string in the free text before the call still ends the answer there
    early = IncrementalDetokenizer(byte_pieces, stop=("\n",), free_text_until="<tool_call>")
    stream_text(early, f"One.\nTwo.{CALL}".encode())
    assert (early.text, early.stop_string) == ("One.", "\n")
    # a match must end before the marker: one that runs into it is not a stop, though the
    # marker is not whole yet when the match is (nothing past the match streams meanwhile)
    for stop in ("e<tool", "<"):
        overlap = IncrementalDetokenizer(byte_pieces, stop=(stop,), free_text_until="<tool_call>")
        deltas = stream_text(overlap, f"Sure{CALL}".encode())
        assert not overlap.stopped and "".join(deltas) == f"Sure{CALL}"
    # ... and when what followed was not the marker after all, the match stops the text
    almost = IncrementalDetokenizer(byte_pieces, stop=("<",), free_text_until="<tool_call>")
    deltas = stream_text(almost, b"a<toolbox> b")
    assert (almost.text, "".join(deltas)) == ("a", "a")
    assert not any("<" in d for d in deltas)
    ended = IncrementalDetokenizer(byte_pieces, stop=("<",), free_text_until="<tool_call>")
    assert "".join(stream_text(ended, b"a<tool")) == "a" == ended.text  # ended still open


def test_no_stop_string_applies_to_output_shaped_from_its_first_token() -> None:
    whole = IncrementalDetokenizer(byte_pieces, stop=('"', "}"), free_text_until="")
    deltas = stream_text(whole, CALL.encode())
    assert not whole.stopped and "".join(deltas) == CALL
    # nothing is held back waiting for a stop string that can no longer match
    assert all(d for d in deltas[:-1])


def test_incomplete_bytes_at_the_end_become_a_replacement_char() -> None:
    detok = IncrementalDetokenizer(byte_pieces)
    deltas = stream_text(detok, "a€".encode()[:-1])
    assert "".join(deltas) == "a\ufffd"


SMOLLM2 = ModelShape("smollm2", 134_515_008, 30, 3, 64, 576, 1536, 49152, 576)


def test_kv_formula_is_the_seed_formula() -> None:
    # 2 x layers x kv_heads x head_dim x bytes, by hand for SmolLM2-135M in float32
    assert kv_bytes_per_token(SMOLLM2, 4) == 2 * 30 * 3 * 64 * 4 == 46_080
    plan = plan_memory(SMOLLM2, "bfloat16", context_len=2048, batch=3)
    assert plan.kv_cache == 2 * 30 * 3 * 64 * 2 * 2048 * 3
    assert plan.weights == 134_515_008 * 2
    assert plan.total == plan.weights + plan.kv_cache + plan.overhead


def test_pages_for_budget_fill_what_is_left() -> None:
    budget = 1 << 30
    pages = pages_for_budget(budget, SMOLLM2, 538_060_032, 4, 16, 512, 16)
    plan = plan_memory(SMOLLM2, "float32", context_len=pages * 16, batch=1)
    assert plan.total <= budget < plan.total + 16 * 46_080
    with pytest.raises(ValueError, match="no room for the KV cache"):
        pages_for_budget(500 << 20, SMOLLM2, 538_060_032, 4, 16, 512, 16)
    # a float16 cache of float32 activations: the same room holds twice the pages
    half = pages_for_budget(budget, SMOLLM2, 538_060_032, 4, 16, 512, 16, kv_dtype_bytes=2)
    assert half == 2 * pages or half == 2 * pages + 1


def test_kv_cache_dtype_picks_the_cache_dtype() -> None:
    assert EngineConfig().kv_torch_dtype == torch.float32
    assert EngineConfig(kv_cache_dtype="float16").kv_torch_dtype == torch.float16
    assert EngineConfig(dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    assert EngineConfig(dtype="float16", kv_cache_dtype="float16").kv_torch_dtype == torch.float16


def test_size_parsers() -> None:
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("4096") == 4096
    assert parse_count("135M") == 135_000_000
    assert parse_count("7B") == 7_000_000_000


def test_plan_cli_counts_the_default_gguf_parameters(capsys: pytest.CaptureFixture) -> None:
    """The plan's parameter count (from the config) equals the GGUF's own tensor sizes."""
    reader = GGUFFile(default_model_path())
    n_elements = sum(math.prod(t.dims) for t in reader.tensors)
    assert main(["--context", "1024", "--json", "--quantization", "none"]) == 0
    out = capsys.readouterr().out
    assert f'"weights": {n_elements * 4}' in out
    assert main(["--context", "1024", "--json"]) == 0  # default: what `make serve` runs
    out = capsys.readouterr().out
    assert '"quantization": "int4"' in out and f'"weights": {n_elements * 4}' not in out
    assert '"kv_cache_dtype": "float16"' in out and f'"kv_cache": {23_040 * 1024}' in out
    assert main(["--context", "1024", "--json", "--kv-cache-dtype", "auto"]) == 0
    assert f'"kv_cache": {46_080 * 1024}' in capsys.readouterr().out
    assert main(["--params", "7B", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                 "--dtype", "bfloat16", "--context", "4096", "--batch", "2"]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "kv cache" in table and f"{2 * 32 * 8 * 128 * 2 * 4096 * 2 / 2**20:.1f}" in table


def test_plan_manual_mode_needs_all_shape_flags() -> None:
    with pytest.raises(SystemExit):
        main(["--params", "7B", "--layers", "32"])
