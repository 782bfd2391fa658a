"""Grammar-constrained decoding: a token mask per sequence from llguidance.

Pieces, from the request inwards:
- `GrammarSpec` (on `SamplingParams`): what the output must match: a JSON schema, a regex, or a
  Lark grammar (llguidance's dialect, which may embed `%json {...}` schemas).
- `GrammarCompiler` (one per engine): the llguidance tokenizer built once from the engine's own
  vocabulary, grammar validation (`check`) and per-sequence `GrammarState`s.
- `GrammarState` (one per constrained sequence): the matcher. It advances only on committed
  tokens (`accept`); speculative decoding checks a draft with `validate_draft` (no state change)
  or accepts draft tokens and undoes the rejected tail with `rollback(n)`.
- `MaskBatch`: the masks of one step, computed in a worker thread while the forward pass runs
  (llguidance releases the GIL), then `apply_token_bitmask` sets disallowed logits to -inf.

The library choice (llguidance over xgrammar) and its measurements are in
`benchmarks/bench_grammar.py`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import llguidance
import torch

from engine.grammar_spec import GrammarError, GrammarSpec, check_grammar

BITS = 32  # tokens per int32 word of a bitmask


class TokenVocabulary(Protocol):
    """What the compiler needs of the engine's tokenizer."""

    vocab_size: int
    stop_token_ids: frozenset[int]
    bos_token_id: int | None

    def token_bytes(self, id: int) -> bytes: ...  # noqa: A002 - tokenizer contract name
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...


class _VocabularyBridge:
    """The duck-typed tokenizer `llguidance.TokenizerWrapper` reads (tokens as raw bytes)."""

    def __init__(self, vocab: TokenVocabulary, special: Sequence[int]) -> None:
        self._vocab = vocab
        stops = sorted(vocab.stop_token_ids)
        self.eos_token_id = stops[0] if stops else 0
        self.bos_token_id = vocab.bos_token_id
        self.tokens = [vocab.token_bytes(i) for i in range(vocab.vocab_size)]
        self.special_token_ids = list(special)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._vocab.encode(text)


class GrammarState:
    """One sequence's matcher. Advance it only with committed (verified) tokens.

    Contract for speculative decoding: `validate_draft(tokens)` says how many draft tokens
    the grammar allows (state unchanged); after verification call `accept` for each committed
    token, or `accept` the draft and `rollback(n)` the n rejected ones.
    """

    __slots__ = ("_matcher", "_stop_ids", "spec")

    def __init__(
        self, matcher: llguidance.LLMatcher, spec: GrammarSpec, stop_ids: frozenset[int]
    ) -> None:
        self._matcher = matcher
        self._stop_ids = stop_ids
        self.spec = spec

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by one committed token (a stop token completes the grammar); False when the
        grammar forbids it, which leaves the matcher in its error state (`error`)."""
        if self._matcher.is_stopped():  # complete: only a stop token may follow
            return token in self._stop_ids and not self._matcher.is_error()
        return bool(self._matcher.consume_token(token))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens < 0:
            raise ValueError(f"rollback count must be >= 0, got {num_tokens}")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise GrammarError(f"cannot roll back {num_tokens} tokens: {self.error}")

    def validate_draft(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts from here (no state change; a stop
        token is not counted, so check the draft without it)."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed-token bits into `bitmask[row]` (int32, CPU)."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and consumed a stop token (or errored)."""
        return bool(self._matcher.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


@dataclass(frozen=True, slots=True)
class GrammarConfig:
    """Compiler settings: cached compiled grammars (count) and mask threads."""

    cache_entries: int = 64
    mask_threads: int = 1

    def __post_init__(self) -> None:
        if self.cache_entries < 1 or self.mask_threads < 1:
            raise ValueError("cache_entries and mask_threads must be >= 1")


class GrammarCompiler:
    """Builds `GrammarState`s for one tokenizer; thread-safe for `check` and `new_state`.

    The llguidance tokenizer (about half a second to build for a 49k-token vocabulary) is
    built by `warm` (a server calls it while starting, so its first constrained request does
    not wait), else on the first constrained request; an engine that never sees one pays
    nothing.
    """

    def __init__(self, vocab: TokenVocabulary, special: Sequence[int] = (),
                 config: GrammarConfig | None = None) -> None:
        self.config = config or GrammarConfig()
        self._vocab = vocab
        self._special = tuple(special)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._building = threading.Lock()  # `warm` runs beside the engine's own thread
        self._grammars: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab.vocab_size

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self.warm()

    def warm(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer, built now if it is not yet (once, whichever thread
        asks first)."""
        with self._building:
            if self._tokenizer is None:
                bridge = _VocabularyBridge(self._vocab, self._special)
                eos = sorted(self._vocab.stop_token_ids) or [0]
                self._tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(bridge), eos_token=eos
                )
            return self._tokenizer

    def _grammar(self, spec: GrammarSpec) -> str:
        grammar = self._grammars.get(spec)
        if grammar is None:
            check_grammar(spec)
            grammar = spec.to_llguidance()
            self._grammars[spec] = grammar
            while len(self._grammars) > self.config.cache_entries:
                self._grammars.popitem(last=False)
        return grammar

    def new_state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for one sequence; GrammarError when the grammar is invalid."""
        matcher = llguidance.LLMatcher(self.tokenizer, self._grammar(spec))
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}")
        return GrammarState(matcher, spec, self._vocab.stop_token_ids)

    def start_masks(self, states: Sequence[GrammarState | None]) -> MaskBatch | None:
        """Begin computing one step's masks (row i for states[i]) in a worker thread;
        None when no row is constrained."""
        if all(s is None for s in states):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.mask_threads, "grammar-mask")
        bitmask = allocate_bitmask(len(states), self.vocab_size)
        return MaskBatch(bitmask, self._pool.submit(_fill_rows, states, bitmask))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _fill_rows(states: Sequence[GrammarState | None], bitmask: torch.Tensor) -> None:
    for row, state in enumerate(states):
        if state is not None:
            state.fill_mask(bitmask, row)


@dataclass(frozen=True, slots=True)
class MaskBatch:
    """A step's bitmask [N, ceil(V / 32)] int32, valid once the fill future is done."""

    bitmask: torch.Tensor
    pending: Future[None]

    def result(self) -> torch.Tensor:
        """Wait for the fill (re-raising its error) and return the bitmask."""
        self.pending.result()
        return self.bitmask


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask [rows, ceil(vocab / 32)] int32."""
    return torch.full((rows, (vocab_size + BITS - 1) // BITS), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bits -> [N, vocab_size] bool (True = allowed); bit j of word w is token
    32 * w + j."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with every token the bitmask forbids set to -inf (a new tensor).

    Logit columns past the bitmask's vocabulary (padding rows of an LM head) are forbidden."""
    vocab = logits.shape[-1]
    allowed = bitmask_to_bool(bitmask.to(logits.device), min(vocab, bitmask.shape[1] * BITS))
    if allowed.shape[1] < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool,
                          device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    return logits.masked_fill(~allowed, float("-inf"))


__all__ = [
    "GrammarCompiler",
    "GrammarConfig",
    "GrammarError",
    "GrammarSpec",
    "GrammarState",
    "MaskBatch",
    "allocate_bitmask",
    "apply_token_bitmask",
    "bitmask_to_bool",
    "check_grammar",
]
