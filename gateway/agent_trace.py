"""Synthetic multi-session agent traffic, for routing tests and the gateway benchmark.

Every session is one agent loop of one shared agent: the same system prompt and tools, then a
task of its own, then turns that each append the assistant's tool call and the tool's output,
so each request's prompt extends the session's previous one (as real agents resend history).
Sessions are interleaved turn by turn, in a seeded shuffled order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

WORDS = ("file", "line", "error", "test", "module", "return", "value", "config", "request",
         "build", "cache", "token", "python", "server", "client", "patch", "diff", "commit",
         "branch", "import", "class", "function", "argument", "result", "status", "output")
TOOLS: tuple[dict[str, Any], ...] = tuple(
    {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ')} in the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}}
    for name in ("read_file", "run_tests", "search_code", "write_file"))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: which session, which turn, and the OpenAI chat body."""

    session: int
    turn: int
    body: dict[str, Any]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def agent_trace(sessions: int, turns: int, *, system_words: int = 600, task_words: int = 200,
                output_words: int = 150, seed: int = 0, model: str = "fake") -> list[TraceRequest]:
    """`sessions` x `turns` requests, interleaved (about 1.2 tokens per word)."""
    if sessions <= 0 or turns <= 0:
        raise ValueError("sessions and turns must be positive")
    rng = random.Random(seed)
    system: dict[str, Any] = {"role": "system", "content": "You are a careful coding agent. " +
              _words(rng, system_words)}
    histories: list[list[dict[str, Any]]] = [
        [system, {"role": "user", "content": f"Task {s}: " + _words(rng, task_words)}]
        for s in range(sessions)]
    out: list[TraceRequest] = []
    for turn in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        for s in order:
            history = histories[s]
            body = {"model": model, "messages": [dict(m) for m in history],
                    "tools": [dict(t) for t in TOOLS]}
            out.append(TraceRequest(s, turn, body))
            call_id = f"call_{s}_{turn}"
            args = json.dumps({"path": f"src/{rng.choice(WORDS)}.py"})
            history.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "read_file", "arguments": args}}]})
            history.append({"role": "tool", "tool_call_id": call_id,
                            "content": _words(rng, output_words)})
    return out
