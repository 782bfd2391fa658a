"""`SamplingParams`: how one request picks its next tokens and when it stops."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from engine.grammar_spec import GrammarSpec


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; every request in a batch may differ.

    temperature: 0 = greedy (argmax); > 0 scales the logits.
    top_p: keep the smallest set of tokens whose probability reaches top_p; in (0, 1].
    top_k: keep the k most likely tokens; 0 = all.
    seed: seeds this request's own torch.Generator (reproducible whatever the batch).
    max_tokens: most generated tokens.
    stop: strings that end generation; the text is cut before the match.
    stop_token_ids: token ids that end generation, besides the tokenizer's stop tokens.
    ignore_eos: do not stop at the tokenizer's stop tokens.
    presence_penalty / frequency_penalty: OpenAI semantics over the generated tokens,
        in [-2, 2].
    logit_bias: token id -> a finite bias added to its logit before sampling (after the grammar
        mask: a token the grammar forbids stays forbidden); a mapping or (id, bias) pairs,
        kept as pairs in id order (`biases`). Ids are checked against the vocabulary when the
        engine builds the sequence (InvalidRequest, field "logit_bias").
    include_stop_str_in_output: keep the matched stop string in the text.
    stop_in_text_before: where free text ends and grammar-shaped output begins, so that stop
        strings never cut a tool call or a JSON document the grammar guarantees whole: stop
        strings are matched only in the text before the first occurrence of this marker (None:
        everywhere; "": nowhere, the whole output is shaped).
    speculative: False turns the engine's speculative decoding off for this request (the
        output is the same either way at temperature 0; only speed differs).
    json_schema / regex / grammar: constrain the output (at most one of them): a JSON schema
        (a mapping or JSON text; kept as JSON text), a regex, or a Lark grammar in llguidance's
        dialect. Each step's logits are masked to the tokens the grammar allows, and generation
        stops when the grammar is complete. Validity against the tokenizer is checked when
        the engine builds the sequence (ValueError naming the problem).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    stop_in_text_before: str | None = None
    speculative: bool = True
    json_schema: str | Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self._check_constraint()
        object.__setattr__(self, "stop", _str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")

    def _check_constraint(self) -> None:
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of json_schema, regex, grammar; got {given}")
        if isinstance(self.json_schema, Mapping):
            object.__setattr__(self, "json_schema", json.dumps(dict(self.json_schema)))
        for name in given:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def constraint(self) -> GrammarSpec | None:
        """The output grammar, or None for unconstrained sampling."""
        if self.json_schema is not None:
            return GrammarSpec.json_schema(str(self.json_schema))
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.grammar is not None:
            return GrammarSpec("lark", self.grammar)
        return None

    @property
    def biases(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs in id order."""
        return cast(tuple[tuple[int, float], ...], self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _str_tuple(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    items = tuple(value)
    if not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    return items


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """A logit_bias mapping or pair sequence as checked (id, bias) pairs in id order."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, tuple | list):
        items = list(value)
    else:
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {value!r}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
        token, bias = item
        _check_int("logit_bias token id", token, low=0)
        _check_float("logit_bias bias", bias)
        if token in pairs:
            raise ValueError(f"logit_bias names token id {token} twice")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _check_int(name: str, value: object, *, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
