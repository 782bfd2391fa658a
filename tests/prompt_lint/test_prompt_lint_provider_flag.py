"""`--provider`: a forced format that the request cannot be is bad input, not a silent misread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prompt_lint.cli import lint_main

SYSTEM = ("You are a support agent for Globex. Be concise and polite. " * 4
          + "Current time: 2026-12-03T10:15:00Z")


def test_an_anthropic_request_forced_to_openai_is_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An Anthropic body (top-level `system`) read as OpenAI lost its system prompt, so a
    timestamp in it went unreported and CI passed (exit 0). Now it is refused (exit 2, one
    line naming the record); read as what it is, the timestamp is an error (exit 1)."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": SYSTEM,
            "messages": [{"role": "user", "content": "Where is my order?"}]}
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(body) + "\n")
    capsys.readouterr()
    assert lint_main([str(log), "--provider", "openai"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and f"{log}:1:" in out.err and "system" in out.err
    assert lint_main([str(log), "--provider", "anthropic"]) == 1
    assert lint_main([str(log)]) == 1
