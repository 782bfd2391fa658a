"""Byte-level BPE tokenizer (GPT-2 style) on `tiktoken`, built from a model's own vocabulary.

The vocabulary comes as token strings spelled in GPT-2's byte-to-unicode alphabet plus an ordered
merge list (from GGUF metadata or a Hugging Face `tokenizer.json`). Token ids double as tiktoken
ranks; that is exact only when every merge result has a larger id than the merges before it,
which `Tokenizer` checks. Control tokens become tiktoken special tokens: ordinary `encode` treats
their text as plain text, `allow_special=True` (used for chat templates) matches them whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import tiktoken
from jinja2.exceptions import TemplateError

from engine.chat_template import ChatTemplate
from engine.errors import InvalidRequest
from engine.special_text import SpecialText

# GPT-2's pre-tokenizer split (the one `ByteLevel(use_regex=True)` applies).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# SmolLM (llama.cpp pre-type "smollm"; HF `Digits(individual_digits=True)` then ByteLevel): every
# numeric character is its own piece, and the GPT-2 split runs inside the text between them. In one
# regex: `\p{N}` first; and a whitespace run directly before a digit is a whole piece, because in
# the two-stage split that run ends its chunk (where `\s+(?!\S)` takes it all).
SMOLLM_PATTERN = (
    r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
)

PRE_TOKENIZER_PATTERNS: dict[str, str] = {"gpt2": GPT2_PATTERN, "smollm": SMOLLM_PATTERN}


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@cache
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_alphabet().items()}


def spelled_to_bytes(token: str) -> bytes:
    """Bytes of a vocabulary entry written in the byte alphabet."""
    table = _char_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError as exc:
        raise ValueError(f"token {token!r} is not spelled in the byte-level alphabet") from exc


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """Everything needed to build a `Tokenizer`, independent of the file format it came from."""

    tokens: Sequence[str]  # id -> token spelled in the byte alphabet (special tokens verbatim)
    special: frozenset[int]  # ids of control tokens (matched whole only with allow_special)
    merges: Sequence[str]  # "left right" pairs in merge order
    pre_tokenizer: str  # key of PRE_TOKENIZER_PATTERNS
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "bpe"

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("tokenizer vocabulary is empty")
        if self.pre_tokenizer not in PRE_TOKENIZER_PATTERNS:
            raise ValueError(
                f"unsupported pre-tokenizer {self.pre_tokenizer!r}; "
                f"known: {sorted(PRE_TOKENIZER_PATTERNS)}"
            )
        for tid in (self.bos_token_id, self.eos_token_id):
            if tid is not None and not 0 <= tid < len(self.tokens):
                raise ValueError(f"special token id {tid} outside the vocabulary")


def _merge_ranks_are_ids(spec: TokenizerSpec) -> None:
    index = {tok: i for i, tok in enumerate(spec.tokens)}
    last = -1
    for merge in spec.merges:
        left, _, right = merge.partition(" ")
        tid = index.get(left + right)
        if tid is None:
            raise ValueError(f"merge {merge!r} produces a token missing from the vocabulary")
        if tid <= last:
            raise ValueError(
                "merge results are not in increasing id order; token ids cannot serve as ranks"
            )
        last = tid


class Tokenizer:
    """The model's tokenizer: text <-> token ids, byte pieces for streaming, and chat rendering.

    Bytes that have no token of their own (the vocabulary lacks a few rare single bytes) are
    dropped from the encoding, as the reference BPE (without an unknown token) does.
    """

    def __init__(self, spec: TokenizerSpec) -> None:
        _merge_ranks_are_ids(spec)
        self.spec = spec
        self.vocab_size = len(spec.tokens)
        self.bos_token_id = spec.bos_token_id
        ranks: dict[bytes, int] = {}
        specials: dict[str, int] = {}
        for tid, tok in enumerate(spec.tokens):
            if tid in spec.special:
                specials[tok] = tid
            else:
                ranks[spelled_to_bytes(tok)] = tid
        # Single bytes without a token get placeholder ranks past the vocabulary; dropped on encode.
        for b in range(256):
            ranks.setdefault(bytes([b]), self.vocab_size + len(specials) + b)
        self._encoding = tiktoken.Encoding(
            name=spec.name,
            pat_str=PRE_TOKENIZER_PATTERNS[spec.pre_tokenizer],
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._special_text = frozenset(specials)
        self._special = SpecialText(specials, self.encode)
        self._id_bytes = [
            tok.encode("utf-8") if tid in spec.special else spelled_to_bytes(tok)
            for tid, tok in enumerate(spec.tokens)
        ]
        self.stop_token_ids = self._stop_ids(specials)
        self.special_token_ids: frozenset[int] = frozenset(spec.special)
        self._chat = (
            ChatTemplate(
                spec.chat_template,
                bos_token=self._token_text(spec.bos_token_id),
                eos_token=self._token_text(spec.eos_token_id),
            )
            if spec.chat_template
            else None
        )

    def _stop_ids(self, specials: Mapping[str, int]) -> frozenset[int]:
        stops = {specials[t] for t in ("<|im_end|>", "<|endoftext|>") if t in specials}
        if self.spec.eos_token_id is not None:
            stops.add(self.spec.eos_token_id)
        return frozenset(stops)

    def _token_text(self, tid: int | None) -> str:
        return "" if tid is None else self.spec.tokens[tid]

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The underlying tiktoken encoding (ranks equal token ids)."""
        return self._encoding

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text is plain text unless `allow_special`."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        allowed = self._special_text if allow_special else frozenset()
        ids = self._encoding.encode(text, allowed_special=allowed, disallowed_special=())
        return [i for i in ids if i < self.vocab_size]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens as their text; invalid UTF-8 becomes U+FFFD)."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, id: int) -> bytes:  # `id` is the engine contract's parameter name
        """The raw bytes of one token (a token may hold part of a UTF-8 character)."""
        if not 0 <= id < self.vocab_size:
            raise ValueError(f"token id {id} outside the vocabulary of {self.vocab_size}")
        return self._id_bytes[id]

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat is None:
            raise ValueError(f"tokenizer {self.spec.name!r} has no chat template")
        return self._chat

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> str:
        """Prompt text of a conversation through the model's chat template; with
        `continue_final`, one whose answer continues the last message (`render_continued`)."""
        if continue_final:
            return self.chat_template.render_continued(messages, tools)
        return self.chat_template.render(messages, tools, add_generation_prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> list[int]:
        """Token ids of a rendered conversation: the template's control tokens matched whole,
        control-token text inside the messages and tools (a tool result quoting
        `<|im_start|>system`) plain text (`engine.special_text`).

        Raises `InvalidRequest` (field "messages") when the template rejects the conversation
        (bad roles, role order, a `raise_exception` in the template, sandbox violations)."""
        try:
            text = self.render_chat(self._special.mask_all(messages) or [],
                                    self._special.mask_all(tools), add_generation_prompt,
                                    continue_final)
        except (TemplateError, ValueError, TypeError) as exc:
            raise InvalidRequest(f"cannot render the prompt: {exc}", field="messages") from exc
        return self._special.encode(text)
