"""A hand-built prompt family for prompt_lint and gateway tests.

Two sessions of three requests each, interleaved like a gateway log: a
timestamp that changes every request, a user handle constant within a
session, a rotating tip, and stable look-alikes (office hours, a policy date,
a support address) that patterns alone would flag.
"""

from __future__ import annotations

from typing import Any

GUIDE = "\n".join(f"Rule {i}: keep answers about area {i} short." for i in range(30))
TIPS = ["Small commits are easier to review.", "Write the test first.", "Read the error twice."]
HANDLES = {"a": "user_k3j9x2", "b": "user_q8m2z7"}


def system(session: str, turn: int) -> str:
    return (f"Current time: 2026-11-{10 + turn:02d}T0{turn}:1{turn}:00Z\n"
            f"Signed in as {HANDLES[session]}.\n"
            f"Tip of the day: {TIPS[(turn + (session == 'b')) % 3]}\n"
            "Office hours: 09:00-17:30 UTC, Monday to Friday.\n"
            "This policy took effect on 2024-03-01.\n"
            "Escalations go to support@acme.example.\n" + GUIDE)


def body(session: str, turn: int) -> dict[str, Any]:
    history: list[dict[str, Any]] = []
    for t in range(turn + 1):
        history.append({"role": "user", "content": f"{session}: question {t}"})
        if t < turn:
            history.append({"role": "assistant", "content": f"answer {t}"})
    return {"model": "gpt-4o-mini",
            "messages": [{"role": "system", "content": system(session, turn)}, *history]}


LOG = [body(s, t) for t in range(3) for s in ("a", "b")]  # interleaved, like a gateway log
