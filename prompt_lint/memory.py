"""The process-wide memos in one place: list them by budget name, resize them to new budgets."""

from __future__ import annotations

from typing import Any

from prompt_lint.budgets import MemoBudgets
from prompt_lint.detectors import SCANNER
from prompt_lint.memo import JSON_MEMO, LRU
from prompt_lint.tokens import DEFAULT_ENCODING, shared_counter
from prompt_lint.toolset import TOOLSET_MEMO


def process_memos() -> dict[str, LRU[Any, Any]]:
    """The process-wide memos by `MemoBudgets` field name (the shared TokenCounter's, the
    pattern scanner's, the JSON and tool-list memos)."""
    return {"json_texts": JSON_MEMO, "tool_sets": TOOLSET_MEMO,
            **shared_counter(DEFAULT_ENCODING).memos(), **SCANNER.memos()}


def apply_budgets(budgets: MemoBudgets) -> None:
    """Resize every process-wide memo to `budgets` (smaller budgets drop the least recently
    used entries now). Hold `prompt_lint.memo.LOCK` when other threads lint."""
    for name, memo in process_memos().items():
        memo.resize(getattr(budgets, name))
