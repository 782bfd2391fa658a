"""What a TemplateLearner keeps: its config, prompt families, their per-path templates, and the
spans and match it reports (see `prompt_lint.templates` for how they are learned)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from prompt_lint.opening import Judged

__all__ = ["Family", "FamilyMatch", "LearnedSpan", "LearnerConfig", "LineSpan", "LineValues",
           "TextSpan"]


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    """Bounds and thresholds of a TemplateLearner."""

    max_families: int = 256
    max_template_chars: int = 262_144
    max_lines: int = 4096
    min_similarity: float = 0.5
    max_sessions: int = 4096
    family_bytes: int = 12 << 20  # families: references, learned state, line index
    memo_bytes: int = 4 << 20  # masked texts, line sets, recent family matches
    session_bytes: int = 4 << 20  # the SessionTracker: histories, rewritten messages

    @property
    def total_bytes(self) -> int:
        """Byte budget of one learner in all."""
        return self.family_bytes + self.memo_bytes + self.session_bytes

    def __post_init__(self) -> None:
        for name in ("max_families", "max_template_chars", "max_lines", "max_sessions",
                     "family_bytes", "memo_bytes", "session_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.min_similarity <= 1.0:
            raise ValueError(f"min_similarity must be in (0, 1], got {self.min_similarity}")


#: Estimated bytes of one `Family.opening_memo` entry (its keys, shares and counts).
_MEMO_BYTES = 512
#: Sessions remembered per family for within-session evidence (least recent dropped).
_SESSIONS_PER_FAMILY = 128


class LearnedSpan(NamedTuple):
    """A span that varies within the family: path of the string, char offsets, and
    `scope`: "request" (seen to change inside a session) or "session" (constant
    inside every session seen, different across sessions)."""

    path: str
    start: int
    end: int
    scope: str = "request"


#: A changed line's values, compared one by one across a session's requests: (reference
#: word, hash of the text aligned there) for each run of words unlike the reference.
LineValues = tuple[tuple[int, int], ...]
#: A learned span on a line: start, end (in the line), its value's first and last
#: reference word (the session evidence that scopes it).
LineSpan = tuple[int, int, int, int]
#: A learned span in a text: start, end, reference line (-1: a line the reference lacks),
#: its value's first and last reference word.
TextSpan = tuple[int, int, int, int, int]


@dataclass(slots=True)
class _Template:
    lines: list[str]
    dynamic: dict[int, set[int]] = field(default_factory=dict)  # line -> word indexes
    #: line -> reference words whose value changed inside a session (per value, not per
    #: line: a timestamp that changes every request leaves a user id on its line in scope)
    within: dict[int, set[int]] = field(default_factory=dict)
    repeats: int = 0  # same-session request pairs compared on this template
    last_text: str = ""
    last_spans: list[TextSpan] = field(default_factory=list)
    last_differ: dict[int, LineValues] | None = None  # line -> values, lines unlike the reference
    #: line -> (last text seen there, its known-dynamic count, its spans and values): session
    #: constants repeat a changed line request after request
    line_memo: dict[int, tuple[str, int, tuple[list[LineSpan], LineValues]]] = field(
        default_factory=dict)


@dataclass(slots=True)
class Family:
    """One prompt family: id, line hashes and word-pair sample, per-path templates,
    cross-request tool state."""

    id: str
    line_hashes: frozenset[int]
    pair_sample: frozenset[int] = frozenset()  # the founding request's (prompt_lint.pairs)
    tools: frozenset[str] = frozenset()  # its tool names: a request with others is not of it
    templates: dict[str, _Template] = field(default_factory=dict)
    chars: int = 0
    requests: int = 0
    tool_names: list[str] | None = None
    tool_blocks: list[int] = field(default_factory=list)  # hashes of recent distinct tool lists
    tool_json: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    last_tools: object | None = None  # the ToolSet of the last request (identity check)
    sessions: set[str] = field(default_factory=set)  # up to two distinct session keys
    bytes: int = 0  # estimated bytes of the templates and hashes, set when founded
    session_bytes: dict[str, int] = field(default_factory=dict)  # session_lines' entries
    #: its last sessions' opening user messages (prompt_lint.opening), by text hash
    openings: OrderedDict[int, str] = field(default_factory=OrderedDict)
    opening_bytes: dict[int, int] = field(default_factory=dict)  # openings' entries
    #: (opening, the openings it was compared with) -> prompt_lint.opening.Judged
    opening_memo: OrderedDict[tuple[int, tuple[int, ...]], Judged] = field(
        default_factory=OrderedDict)

    @property
    def held_bytes(self) -> int:
        """Estimated bytes held: templates, hashes, the session evidence and openings."""
        return (self.bytes + sum(self.session_bytes.values()) + sum(self.opening_bytes.values())
                + _MEMO_BYTES * len(self.opening_memo))
    session_lines: OrderedDict[str, dict[str, dict[int, LineValues] | None]] = field(
        default_factory=OrderedDict)  # session -> template key -> last differing lines

    @property
    def settled(self) -> bool:
        """Whether two sessions were seen: enough evidence to call unchanged text stable."""
        return len(self.sessions) >= 2


class FamilyMatch(NamedTuple):
    """What observe() found: the family (or None), its learned spans, and the paths
    whose unchanged text is proven stable by the family's evidence."""

    family: Family | None
    spans: list[LearnedSpan]
    settled: frozenset[str] = frozenset()
    partial: frozenset[str] = frozenset()  # two sessions seen, but no session's second request
