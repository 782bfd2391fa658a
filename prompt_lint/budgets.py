"""Byte budgets of prompt_lint's process-wide memos: one frozen config, one documented total.

Every memo that can hold prompt-sized data (whole texts, their token ids, their lines) is a
`prompt_lint.memo.LRU` bounded by estimated bytes; its budget is a named field here. The
defaults add up to `MemoBudgets().total` (124 MiB). Per-learner state (prompt families, the
learner's memos, sessions) has its own byte budgets in `LearnerConfig`; the gateway keeps one
learner per tenant. `prompt_lint.memory.apply_budgets` resizes the live memos.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class MemoBudgets:
    """Byte budget of each process-wide memo (estimated bytes of keys and values held)."""

    json_texts: int = 16 * MIB  # compact JSON of tools, messages, blocks (memo.JSON_MEMO)
    tool_sets: int = 8 * MIB  # per tool list facts (toolset.TOOLSET_MEMO)
    token_chunks: int = 32 * MIB  # chunk -> token ids (tokens.TokenCounter)
    token_texts: int = 16 * MIB  # whole text -> token ids
    token_counts: int = 4 * MIB  # whole text -> token count
    token_pieces: int = 16 * MIB  # long texts cut in chunks, per slot (incremental counting)
    pattern_lines: int = 8 * MIB  # line -> detected spans (detectors.PatternScanner)
    pattern_texts: int = 8 * MIB  # whole text -> detected spans
    pattern_pieces: int = 16 * MIB  # long texts cut in lines, per slot (incremental scanning)

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1 byte, got {getattr(self, f.name)}")

    @property
    def total(self) -> int:
        """Bytes of all the budgets together."""
        return sum(getattr(self, f.name) for f in fields(self))


#: The budgets the process-wide memos are built with.
BUDGETS = MemoBudgets()

