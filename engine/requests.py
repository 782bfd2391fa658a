"""From a request (prompt, sampling params, namespace) to a validated `Sequence`.

Validation happens here, before anything is queued: an empty prompt, a token id outside the
vocabulary (in the prompt or the logit bias) or a prompt that can never fit is an
`InvalidRequest` / `RequestTooLong`, and a
grammar that does not compile a `GrammarError`. Building touches no engine state, so the async
front calls it on the caller's thread and errors reach the caller directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequest, RequestTooLong
from engine.grammar import GrammarCompiler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

Prompt = str | Seq[int]


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the longest sequence, and where the limit comes
    from (the model's context and the KV pool), for the error message."""

    vocab_size: int
    max_seq_len: int
    max_model_len: int
    pool_tokens: int
    device: str
    seed: int


class SequenceFactory:
    """Builds validated `Sequence`s: ids, stop tokens, detokenizer, generator, grammar state."""

    def __init__(self, limits: RequestLimits, tokenizer: Tokenizer,
                 grammar: GrammarCompiler) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.grammar = grammar
        self._generator = torch.Generator(device=limits.device).manual_seed(limits.seed)
        self._ids = itertools.count()

    def build(self, prompt: Prompt, params: SamplingParams | None = None, namespace: str = "",
              request_id: str | None = None) -> Sequence:
        """The request's `Sequence`; raises for bad input (see the module docstring)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        ids = self.prompt_ids(prompt)
        lim = self.limits
        outside = [t for t, _ in params.biases if t >= lim.vocab_size]
        if outside:
            raise InvalidRequest(f"logit_bias token ids outside the vocabulary of "
                                 f"{lim.vocab_size}: {outside[:5]}", field="logit_bias")
        limit = lim.max_seq_len - 1
        if len(ids) > limit:
            raise RequestTooLong(
                prompt_tokens=len(ids), limit=limit,
                detail=f"max_model_len={lim.max_model_len}, KV pool={lim.pool_tokens} tokens",
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stops = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.tokenizer.stop_token_ids
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=lim.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(
            self.tokenizer.token_bytes, params.stop, params.include_stop_str_in_output,
            free_text_until=params.stop_in_text_before,
        )
        spec = params.constraint
        grammar = self.grammar.new_state(spec) if spec is not None else None
        return Sequence(rid, ids, params, namespace, generator, lim.max_seq_len, stops, detok,
                        grammar=grammar)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of `prompt` (text is encoded; ids are checked against the vocabulary)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", field="prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token ids outside the vocabulary: {bad[:5]}",
                                     field="prompt")
        if not ids:
            raise InvalidRequest("prompt must not be empty (it encodes to no tokens)",
                                 field="prompt")
        return ids
