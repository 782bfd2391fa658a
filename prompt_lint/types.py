"""Result types of prompt_lint: findings, reports, rewrite results."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from prompt_lint.rules import Severity


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem in one request.

    `path` names the string or structure (`messages[0].content`, `system`,
    `tools[2].function.description`, `tools`); `start`/`end` are character
    offsets into the string at `path` (None for structural findings); `value`
    is the raw span text ("" for structural findings); `token_offset` is the
    token position of `start` in the request's token layout (None when the
    finding has no position); `confidence` (0.0-1.0) is 1.0 for what the prompt
    family's requests showed to vary (and for structural findings), and the
    detector's confidence for a pattern match with no such evidence.
    """

    rule: str
    name: str
    severity: Severity
    kind: str
    path: str
    start: int | None
    end: int | None
    message: str
    value: str = ""
    token_offset: int | None = None
    confidence: float = 1.0

    def to_json(self, show_values: bool = True) -> dict[str, Any]:
        """The finding as a JSON-ready dict (value masked unless `show_values`)."""
        data = {name: getattr(self, name) for name in _FINDING_FIELDS}  # asdict, flat
        if not show_values:
            data["value"] = mask_value(self.value, self.kind)
        return data


_FINDING_FIELDS = tuple(f.name for f in fields(Finding))


def mask_value(value: str, kind: str) -> str:
    """A masked stand-in that keeps the kind and length but not the text."""
    return f"<{kind}:{len(value)} chars>" if value else ""


@dataclass(frozen=True, slots=True)
class LintReport:
    """What lint_request found in one request, and what the prefix is worth.

    `cacheable_tokens`: tokens before the first position that will differ in
    the next request of this prompt family; `cacheable_tokens_after_fix`: the
    same after `rewrite_request`; `family`: the learner's prompt family id.
    """

    findings: list[Finding]
    prompt_tokens: int
    cacheable_tokens: int
    cacheable_tokens_after_fix: int
    family: str | None = None
    provider: str = "openai"
    # the first user message when the family's sessions share its text: the fix puts a
    # context block it gives that message at its end, below that text (prompt_lint.opening)
    shared_opening: int | None = None


@dataclass(frozen=True, slots=True)
class RewriteResult:
    """A rewritten request: `body` (same provider format), the moved values, changed flag."""

    body: dict[str, Any]
    moved: list[str] = field(default_factory=list)
    changed: bool = False
