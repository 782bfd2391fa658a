"""What a constrained output must match (`GrammarSpec`), and the error a bad one raises.

Kept apart from `engine.grammar` so that `SamplingParams` (and the gateway's config) import
without torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from engine.errors import InvalidRequest

GrammarKind = Literal["json_schema", "regex", "lark"]


class GrammarError(InvalidRequest):
    """A grammar (schema, regex, Lark text) that llguidance rejects; the message names why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="grammar")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a constrained output must match. `source` is JSON text for "json_schema"."""

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "regex", "lark"):
            raise ValueError(f"grammar kind must be json_schema, regex or lark, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"{self.kind} must be a non-empty string")

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any]) -> GrammarSpec:
        """A spec from a schema given as a mapping or as JSON text (key order is kept)."""
        if isinstance(schema, Mapping):
            return cls("json_schema", json.dumps(schema, ensure_ascii=False))
        try:
            parsed = json.loads(schema)
        except (TypeError, json.JSONDecodeError) as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict | bool):
            raise GrammarError("json_schema must be a JSON object")
        return cls("json_schema", schema)

    def to_llguidance(self) -> str:
        """The llguidance grammar text for this spec."""
        if self.kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(self.source))
        if self.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(self.source))
        return str(llguidance.LLMatcher.grammar_from_lark(self.source))


def check_grammar(spec: GrammarSpec) -> None:
    """Raise GrammarError unless llguidance accepts `spec` (no tokenizer needed).

    Unsupported JSON-schema keywords are errors, not silently ignored constraints."""
    try:
        grammar = spec.to_llguidance()
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid {spec.kind}: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise GrammarError(f"invalid {spec.kind}: {'; '.join(messages) or 'rejected'}")
