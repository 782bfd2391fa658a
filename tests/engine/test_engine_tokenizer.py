"""The tiktoken-based tokenizer against the tokenizer `transformers` builds from the same GGUF.

transformers maps this GGUF's pre-tokenizer name ("smollm") to nothing and falls back to plain
GPT-2 splitting, which keeps digit runs together. SmolLM2's own tokenizer.json and llama.cpp's
"smollm" pre-type split every digit on its own, so the reference here is transformers' GGUF
tokenizer with that pre-tokenizer (Digits(individual_digits) then ByteLevel) put back. A second
test checks digit-free text against the unmodified transformers tokenizer.
"""

from __future__ import annotations

import json
import random
import unicodedata
from typing import Any

import pytest

from engine.loader import LoadedModel
from engine.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

CORPUS_SEED = 20241129
CORPUS_MIN_BYTES = 200_000

_WORD_TEXT = """the of and to in is you that it he was for on are as with his they I at be this
have from or one had by word but not what all were we when your can said there use an each which
she do how their if will up other about out many then them these so some her would make like
model token cache prefix engine gateway agent tool request stream latency"""
WORDS = _WORD_TEXT.split()
SCRIPTS = {
    "cjk": (0x4E00, 0x9FFF),
    "hiragana": (0x3041, 0x3096),
    "katakana": (0x30A1, 0x30FA),
    "hangul": (0xAC00, 0xD7A3),
    "cyrillic": (0x0410, 0x044F),
    "greek": (0x0391, 0x03C9),
    "arabic": (0x0621, 0x064A),
    "hebrew": (0x05D0, 0x05EA),
    "devanagari": (0x0905, 0x0939),
    "thai": (0x0E01, 0x0E2E),
    "latin_ext": (0x00C0, 0x017F),
}
EMOJI = ["😀", "🚀", "🎉", "👍", "👍🏽", "❤️", "🇫🇷", "🇯🇵", "👨‍👩‍👧", "🧑‍💻", "✅", "🔥"]
EMOJI += ["🙈", "🤖", "🥲"]
ODD_DIGITS = ["٣", "४", "４", "²", "½", "Ⅻ", "⅛", "၃", "𝟗", "①"]
WHITESPACE = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000"]
WHITESPACE += ["    ", " \t "]


def _words(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        word = rng.choice(WORDS)
        roll = rng.random()
        if roll < 0.1:
            word = word.capitalize()
        elif roll < 0.15:
            word = word.upper()
        elif roll < 0.2:
            word += rng.choice(["'s", "'t", "'re", "'ve", "'ll", "'d", "'m", "'S", "n't"])
        out.append(word)
    return " ".join(out)


def _prose(rng: random.Random) -> str:
    sentences = [_words(rng, rng.randint(3, 14)) + rng.choice(".!?;:,") for _ in range(6)]
    return " ".join(sentences)


def _code(rng: random.Random) -> str:
    name = "_".join(rng.sample(WORDS, 2))
    indent = rng.choice(["    ", "  ", "\t"])
    lines = [
        f"def {name}(x: int, y: float = {rng.uniform(-9, 9):.3f}) -> dict[str, int]:",
        f'{indent}"""{_words(rng, 6)}."""',
        f"{indent}if x >= {rng.randint(0, 99999)} and y != {rng.random():.2e}:",
        f"{indent}{indent}return {{'{name}': x ** 2 + {rng.randint(1, 9)}}}",
        f"{indent}for i in range({rng.randint(1, 500)}):  # {_words(rng, 3)}",
        f"{indent}{indent}x += i << {rng.randint(1, 8)} | 0x{rng.randint(0, 2**32):08X}",
        "",
        f"const {name} = (a, b) => {{ return a?.b ?? [{rng.randint(0, 9)}, -{rng.random()}]; }};",
        f'#include <stdio.h>\nint main(void) {{ printf("%d\\n", {rng.randint(-9**6, 9**6)}); }}',
        f"SELECT id, name FROM users WHERE age > {rng.randint(18, 90)} ORDER BY id DESC;",
    ]
    return "\n".join(lines) + "\n"


def _json_value(rng: random.Random, depth: int) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.3:
        return rng.choice([
            rng.randint(-(10**9), 10**9),
            round(rng.uniform(-1e4, 1e4), rng.randint(0, 6)),
            rng.random() * 10 ** rng.randint(-12, 12),
            _words(rng, rng.randint(1, 4)),
            rng.choice([True, False, None]),
            _script_text(rng, 5),
        ])
    if roll < 0.65:
        return {f"{rng.choice(WORDS)}_{i}": _json_value(rng, depth + 1) for i in range(4)}
    return [_json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))]


def _json(rng: random.Random) -> str:
    value = {"id": rng.randint(0, 10**6), "data": _json_value(rng, 0)}
    indent = rng.choice([None, 2, 4])
    return json.dumps(value, indent=indent, ensure_ascii=rng.random() < 0.3)


def _numbers(rng: random.Random) -> str:
    parts = [
        f"{rng.randint(0, 10**12):,}",
        f"{rng.uniform(-1000, 1000):.{rng.randint(0, 8)}f}",
        f"+1 ({rng.randint(100, 999)}) {rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
        f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T12:00:00Z",
        f"v{rng.randint(0, 9)}.{rng.randint(0, 99)}.{rng.randint(0, 999)}",
        f"{rng.randint(1, 99)}%",
        f"${rng.randint(0, 9999)}.{rng.randint(0, 99):02d}",
        "".join(rng.choice(ODD_DIGITS) for _ in range(rng.randint(1, 5))),
        str(rng.randint(0, 10**30)),
        f" {rng.randint(0, 99)}  {rng.randint(0, 99)}   {rng.randint(0, 99)}",
    ]
    rng.shuffle(parts)
    return " ".join(parts)


def _script_text(rng: random.Random, n: int) -> str:
    low, high = SCRIPTS[rng.choice(sorted(SCRIPTS))]
    chunks = []
    for _ in range(n):
        chunks.append("".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 6))))
    return rng.choice([" ", "", "、", "，"]).join(chunks)


def _mixed(rng: random.Random) -> str:
    pieces = [_script_text(rng, 4), _words(rng, 3), rng.choice(EMOJI), _script_text(rng, 3)]
    pieces += [rng.choice(EMOJI) * rng.randint(1, 3), str(rng.randint(0, 999))]
    rng.shuffle(pieces)
    return "".join(p + rng.choice(WHITESPACE) for p in pieces)


def _whitespace(rng: random.Random) -> str:
    out = []
    for _ in range(20):
        out.append(rng.choice([_words(rng, 2), str(rng.randint(0, 99)), rng.choice(EMOJI)]))
        out.append("".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 4))))
    return "".join(out)


def _random_unicode(rng: random.Random) -> str:
    chars = []
    while len(chars) < 60:
        cp = rng.choice([rng.randint(0x20, 0x2FFF), rng.randint(0x1F000, 0x1FAFF),
                         rng.randint(0x20000, 0x10FFFF), rng.randint(0, 0x1F)])
        ch = chr(cp)
        if unicodedata.category(ch) not in ("Cs", "Cn", "Co"):
            chars.append(ch)
    return "".join(chars)


GENERATORS = (_prose, _code, _json, _numbers, _mixed, _whitespace, _random_unicode)


def generate_corpus(seed: int = CORPUS_SEED, min_bytes: int = CORPUS_MIN_BYTES) -> list[str]:
    """Deterministic documents (code, JSON, numbers, CJK, emoji, whitespace runs, mixed scripts)."""
    rng = random.Random(seed)
    docs: list[str] = []
    size = 0
    while size < min_bytes:
        doc = "".join(rng.choice(GENERATORS)(rng) for _ in range(rng.randint(1, 4)))
        docs.append(doc)
        size += len(doc.encode("utf-8"))
    return docs


def _backend(hf_tokenizer: Any, smollm_split: bool) -> Any:
    """A standalone copy of transformers' backend tokenizer, optionally with SmolLM's split."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import pre_tokenizers

    backend = RustTokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    if smollm_split:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return backend


def _assert_same(ours: Tokenizer, reference: Any, docs: list[str]) -> None:
    expected = [e.ids for e in reference.encode_batch(docs, add_special_tokens=False)]
    for i, (doc, want) in enumerate(zip(docs, expected, strict=True)):
        got = ours.encode(doc)
        if got != want:
            diffs = (j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            at = next(diffs, min(len(got), len(want)))
            near = ours.decode(want[max(0, at - 3) : at + 3])
            pytest.fail(
                f"doc {i} differs at token {at}: ours {got[at : at + 6]} "
                f"reference {want[at : at + 6]} near {near!r}"
            )


def test_corpus_is_large_and_varied() -> None:
    docs = generate_corpus()
    text = "".join(docs)
    assert len(text.encode("utf-8")) >= CORPUS_MIN_BYTES
    assert generate_corpus() == docs  # deterministic
    for needle in ("def ", '{"id"', "\t", "\n\n", "   ", "👍", "'s"):
        assert needle in text
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)
    assert any(ord(ch) >= 0x1F300 for ch in text)


def test_encode_equals_transformers_gguf_tokenizer(
    loaded_model: LoadedModel, hf_gguf_tokenizer: Any
) -> None:
    _assert_same(loaded_model.tokenizer, _backend(hf_gguf_tokenizer, True), generate_corpus())


def test_digit_free_text_equals_unmodified_transformers(
    loaded_model: LoadedModel, hf_gguf_tokenizer: Any
) -> None:
    docs = ["".join(ch for ch in d if not ch.isnumeric()) for d in generate_corpus(7, 60_000)]
    _assert_same(loaded_model.tokenizer, _backend(hf_gguf_tokenizer, False), docs)


def test_digits_are_split_one_by_one(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_decode_round_trips_and_token_bytes_stream(loaded_model: LoadedModel) -> None:
    tok = loaded_model.tokenizer
    # Characters below U+10000 (and no C0 controls but tab/newlines) never use the few bytes
    # that have no token of their own, so they must round-trip exactly.
    for doc in generate_corpus(3, 20_000):
        doc = "".join(ch for ch in doc if ch in "\t\n\r" or 0x20 <= ord(ch) < 0x10000)
        ids = tok.encode(doc)
        assert b"".join(tok.token_bytes(i) for i in ids) == doc.encode("utf-8")
        assert tok.decode(ids) == doc


def test_special_tokens_are_text_unless_allowed(
    loaded_model: LoadedModel, hf_gguf_tokenizer: Any
) -> None:
    tok = loaded_model.tokenizer
    text = "a <|im_end|> b <|endoftext|><|im_start|>user"
    plain = hf_gguf_tokenizer(text, add_special_tokens=False, split_special_tokens=True)
    assert tok.encode(text) == plain["input_ids"]
    assert tok.encode(text, allow_special=True) == hf_gguf_tokenizer.encode(
        text, add_special_tokens=False
    )
    im_end = tok.encode("<|im_end|>", allow_special=True)
    assert len(im_end) == 1 and im_end[0] in tok.stop_token_ids
    assert tok.encode("<|endoftext|>", allow_special=True)[0] in tok.stop_token_ids
    assert len(tok.encode("<|im_end|>")) > 1


def test_bad_ids_raise(loaded_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        loaded_model.tokenizer.token_bytes(loaded_model.tokenizer.vocab_size)
    with pytest.raises(TypeError):
        loaded_model.tokenizer.encode(b"bytes")  # type: ignore[arg-type]
