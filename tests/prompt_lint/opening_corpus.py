"""A labelled log of first user messages: values above text the sessions share, and look-alikes.

Every family's sessions open with a user message; some put a per-session value (a time, a user id, a
nonce, a customer's name that no pattern names) on a line above a guide that every session of the
family sends: those values are labelled (PL014 should report them). Others carry dates and ids where
moving them shares nothing: below the guide, in the user's own words, or above a line of the user's
own words. Those are not labelled, and a PL014 finding on them is a false positive. Shared by
tests/prompt_lint/test_prompt_lint_opening.py and benchmarks/bench_lint.py.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

WORDS = ["invoice", "refund", "router", "billing", "password", "delivery", "warranty", "screen",
         "battery", "account", "shipping", "upgrade", "cancel", "error", "charger", "login",
         "firmware", "backup", "printer", "network", "license", "subscription", "modem", "cable"]


class OpeningRequest(NamedTuple):
    """One request of the log: its body, its family and session, and the labelled values of its
    first user message as (path, start, end)."""

    body: dict[str, Any]
    family: str
    session: str
    labels: list[tuple[str, int, int]]


class _Opening(NamedTuple):
    text: str
    labels: list[tuple[int, int]]  # character spans in `text`


def _guide(family: int) -> str:
    topic = WORDS[family % len(WORDS)]
    return "\n".join(f"Step {family}.{i}: for {topic} cases, open the {WORDS[(i + family) % 24]} "
                     f"page, check the {WORDS[(3 * i) % 24]} status and log what you changed."
                     for i in range(70))


def _own_words(rng: random.Random, n: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _labelled(*parts: tuple[str, bool]) -> _Opening:
    """Join text parts; the parts marked True are labelled values."""
    text, labels = "", []
    for part, label in parts:
        if label:
            labels.append((len(text), len(text) + len(part)))
        text += part
    return _Opening(text, labels)


def _time_above(g: str, t: datetime, rng: random.Random, s: int) -> _Opening:
    return _labelled(("Current time: ", False), (t.strftime("%Y-%m-%dT%H:%M:%SZ"), True),
                     (f"\n\nHere is the guide:\n{g}\n\nQuestion: {_own_words(rng, 12)}?", False))


def _id_and_date_above(g: str, t: datetime, rng: random.Random, s: int) -> _Opening:
    return _labelled(("user_id: ", False), (f"u_{rng.randint(10000, 99999)}", True),
                     ("\nSession started ", False),
                     (t.strftime("%a, %d %b %Y %H:%M:%S +0000"), True),
                     (f"\n\n{g}\n\n{_own_words(rng, 20)}", False))


def _nonce_and_uuid_above(g: str, t: datetime, rng: random.Random, s: int) -> _Opening:
    return _labelled(("Greetings from the support console.\nRequest nonce: ", False),
                     ("".join(rng.choice("ABCDEFGHJKabcdefghjk0123456789") for _ in range(24)),
                      True),
                     ("\nTrace: ", False), (str(uuid.UUID(int=rng.getrandbits(128))), True),
                     (f"\n\nReference:\n{g}\n\nTask: {_own_words(rng, 15)}", False))


NAMES = ["Maria Lopez", "Dae-jung Kim", "Priya Raman", "Tom Berg", "Wei Chen", "Jonas Weber",
         "Anna Nowak", "Omar Haddad", "Lena Fischer", "Kofi Mensah"]


def _name_above(g: str, t: datetime, rng: random.Random, s: int) -> _Opening:
    """A value no pattern names: the customer's name, on a line of its own."""
    return _labelled(("Customer: ", False), (NAMES[s % len(NAMES)], True),
                     (f"\n\nHandbook:\n{g}\n\nQuestion: {_own_words(rng, 12)}", False))


def _values_below(g: str, t: datetime, rng: random.Random, s: int) -> _Opening:
    return _labelled((f"Here is the guide:\n{g}\n\nQuestion about order id: "
                      f"ORD-{rng.randint(10000, 99999)} placed on {t:%Y-%m-%d}: "
                      f"{_own_words(rng, 30)}", False))


def _own_question(g: str, t: datetime, rng: random.Random, s: int) -> _Opening:
    return _labelled((f"My account email is user{rng.randint(100, 999)}@example.com and since "
                      f"{t:%d %B %Y %H:%M} {_own_words(rng, 80)}", False))


def _date_above_own_words(g: str, t: datetime, rng: random.Random, s: int) -> _Opening:
    return _labelled((f"Today is {t:%Y-%m-%d %H:%M}.\n{_own_words(rng, 40)}\n\n{g}", False))


KINDS: tuple[Callable[[str, datetime, random.Random, int], _Opening], ...] = (
    _time_above, _id_and_date_above, _nonce_and_uuid_above, _name_above, _values_below,
    _own_question, _date_above_own_words)


def build_openings(seed: int = 3, sessions: int = 8) -> list[OpeningRequest]:
    """Two families per kind (one OpenAI, one Anthropic with content blocks), `sessions`
    sessions each of one to four turns, interleaved by session."""
    rng = random.Random(seed)
    start = datetime(2026, 11, 2, 8, 0, tzinfo=UTC)
    plan = [(f, KINDS[f // 2], "anthropic" if f % 2 else "openai") for f in range(2 * len(KINDS))]
    out: list[OpeningRequest] = []
    for s in range(sessions):
        for f, kind, provider in plan:
            t = start + timedelta(days=s, minutes=rng.randint(0, 600), seconds=rng.randint(0, 59))
            opening = kind(_guide(f), t, rng, s)
            out += _session(f, s, provider, opening, rng.randint(1, 4))
    return out


def _session(f: int, s: int, provider: str, opening: _Opening, turns: int
             ) -> list[OpeningRequest]:
    words = random.Random(f).sample(WORDS, 12)
    system = (f"You are the {words[0]} assistant of the {words[1]} and {words[2]} team. "
              f"Answer questions on {', '.join(words[3:])} from the material you are given.")
    anthropic = provider == "anthropic"
    first: dict[str, Any] = {"role": "user", "content": [{"type": "text", "text": opening.text}]
                             if anthropic else opening.text}
    path = "messages[0].content[0].text" if anthropic else "messages[1].content"
    history: list[dict[str, Any]] = [first]
    out = []
    for turn in range(turns):
        body: dict[str, Any] = ({"model": "claude-sonnet-4-5", "max_tokens": 256,
                                 "system": system, "messages": list(history)} if anthropic else
                                {"model": "gpt-4o", "messages": [
                                    {"role": "system", "content": system}, *history]})
        out.append(OpeningRequest(body, f"family{f}", f"family{f}-s{s}",
                                  [(path, a, b) for a, b in opening.labels]))
        history += [{"role": "assistant", "content": f"Answer {turn} of session {s}."},
                    {"role": "user", "content": f"follow-up {turn}"}]
    return out


def score_openings(requests: list[OpeningRequest], findings: list[list[tuple[str, int, int]]]
                   ) -> tuple[float, float, int]:
    """(precision, recall, labels) of the PL014 findings (path, start, end) per request: a
    finding is right when it overlaps a labelled value, a label is found when one does."""
    right = wrong = found = labels = 0
    for req, got in zip(requests, findings, strict=True):
        for path, start, end in got:
            hit = any(p == path and start < b and a < end for p, a, b in req.labels)
            right, wrong = right + hit, wrong + (not hit)
        for p, a, b in req.labels:
            labels += 1
            found += any(path == p and start < b and a < end for path, start, end in got)
    return (right / (right + wrong) if right + wrong else 1.0,
            found / labels if labels else 1.0, labels)


def pl014_findings(requests: list[OpeningRequest], online: bool = False
                   ) -> list[list[tuple[str, int, int]]]:
    """The PL014 findings (path, start, end) of each request: two-pass as `prefixgate lint`
    (learn the log, freeze, lint), or online as the gateway (one learner, request by request)."""
    from prompt_lint import TemplateLearner, learn_request, lint_request

    learner = TemplateLearner()
    if not online:
        for req in requests:
            learn_request(req.body, learner)
        learner.freeze()
    reports = [lint_request(req.body, learner=learner) for req in requests]
    return [[(f.path, f.start or 0, f.end or 0) for f in rep.findings if f.rule == "PL014"]
            for rep in reports]


def fixed_requests(requests: list[OpeningRequest]) -> list[OpeningRequest]:
    """The log as two-pass `prefixgate fix` writes it (labels kept as they were)."""
    from prompt_lint import TemplateLearner, learn_request, lint_request, rewrite_request

    learner = TemplateLearner()
    for req in requests:
        learn_request(req.body, learner)
    learner.freeze()
    return [req._replace(body=rewrite_request(req.body, report=lint_request(
        req.body, learner=learner), learner=learner).body) for req in requests]
