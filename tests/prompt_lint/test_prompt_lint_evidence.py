"""Evidence over patterns on a small hand-built prompt family.

Two sessions of three requests each: a timestamp that changes every request,
a user handle constant within a session, a rotating tip, and stable
look-alikes (office hours, a policy date, a support address) that patterns
alone would flag. Expected values are written out by hand.
"""

from __future__ import annotations

from typing import Any

import pytest

from prompt_lint import TemplateLearner, learn_request, lint_request, rewrite_request
from prompt_lint.evidence import FIX_CONFIDENCE
from prompt_lint.family import _SESSIONS_PER_FAMILY
from tests.support.lint_family import LOG, body


def two_pass(log: list[dict[str, Any]] = LOG) -> tuple[TemplateLearner, list[Any]]:
    learner = TemplateLearner()
    for b in log:
        learn_request(b, learner)
    learner.freeze()
    return learner, [lint_request(b, learner=learner) for b in log]


def values(report: Any) -> dict[str, tuple[str, float, str]]:
    return {f.value: (f.rule, f.confidence, f.severity) for f in report.findings
            if f.start is not None}


def test_without_evidence_patterns_carry_their_confidence() -> None:
    found = values(lint_request(LOG[0]))
    assert found["2026-11-10T00:10:00Z"] == ("PL001", 0.95, "error")  # cue "Current time"
    assert found["09:00"][0] == "PL001" and found["09:00"][1] < FIX_CONFIDENCE
    assert found["09:00"][2] == "warning"
    assert found["2024-03-01"][1] < FIX_CONFIDENCE
    assert found["support@acme.example"][1] < FIX_CONFIDENCE
    assert "user_k3j9x2" not in found  # no pattern names a handle


def test_with_evidence_what_varies_is_dynamic_and_the_rest_is_stable() -> None:
    _, reports = two_pass()
    for b, report in zip(LOG, reports, strict=True):
        found = values(report)
        text = b["messages"][0]["content"]
        stamp = text.split("\n")[0].removeprefix("Current time: ")
        tip = text.split("\n")[2].removeprefix("Tip of the day: ")
        handle = text.split("\n")[1].removeprefix("Signed in as ").rstrip(".")
        assert found == {stamp: ("PL001", 1.0, "error"),
                         handle: ("PL013", 1.0, "error"),
                         tip.rstrip("."): ("PL008", 1.0, "warning")}, found


def test_a_finding_from_evidence_says_how_much_evidence() -> None:
    """The message named no evidence ("varies across requests of this prompt family"):
    nothing told one request that varied once from a value seen in every request of a long
    log. The log is two sessions of three requests."""
    _, reports = two_pass()
    for report in reports:
        messages = {f.rule: f.message for f in report.findings if f.start is not None}
        assert set(messages) == {"PL001", "PL013", "PL008"}
        assert all(m.endswith(" (evidence: 6 requests in 2 sessions)")
                   for m in messages.values()), messages
    alone = lint_request(LOG[0]).findings[0].message
    assert alone.endswith("(pattern only, no evidence from the family)")


def test_fix_moves_only_supported_values() -> None:
    single = LOG[0]
    fixed = rewrite_request(single, report=lint_request(single)).body
    text = fixed["messages"][0]["content"]
    assert "2026-11-10T00:10:00Z" not in text  # a confident pattern: moved
    assert "09:00-17:30 UTC" in text and "2024-03-01" in text  # look-alikes: left in place
    learner, reports = two_pass()
    fixed = rewrite_request(LOG[-1], report=reports[-1], learner=learner).body
    text = fixed["messages"][0]["content"]
    assert "user_q8m2z7" not in text and "Read the error twice" not in text
    assert "09:00-17:30 UTC" in text and "support@acme.example" in text
    assert "user_q8m2z7" in fixed["messages"][-1]["content"]  # in the context block


def test_online_learns_the_same_once_settled() -> None:
    learner = TemplateLearner()
    reports = [lint_request(b, learner=learner) for b in LOG]
    last = values(reports[-1])
    assert {v[0] for v in last.values()} == {"PL001", "PL013", "PL008"}
    assert all(v[1] == 1.0 for v in last.values())


def test_session_evidence_memory_is_bounded() -> None:
    learner = TemplateLearner()
    for n in range(_SESSIONS_PER_FAMILY + 40):
        b = body("a", 1)
        b["messages"][1]["content"] = f"session {n}: question 0"
        lint_request(b, learner=learner)
    (family,) = learner.families.values()
    assert len(family.session_lines) == _SESSIONS_PER_FAMILY
    assert len(family.sessions) == 2


HANDLES = ["u-7061", "u-2073", "u-5518", "u-9042"]


def one_line_log(system: Any) -> list[dict[str, Any]]:
    """One request per handle: the one-line system prompt `system(i, handle)`, a question."""
    return [{"model": "gpt-4o", "messages": [
        {"role": "system", "content": system(i, h)},
        {"role": "user", "content": f"Fix bug #{i} in the parser"}]}
        for i, h in enumerate(HANDLES)]


def test_a_one_line_system_prompt_with_an_unnamed_value_is_one_family() -> None:
    """Requests whose only template line differs by a value no pattern names (a handle in
    the middle of a one-line system prompt) are one family, and the value is learned: before,
    the line's hash differed in every request, each request founded its own family, the
    value was never seen to vary and the whole prompt counted as cacheable."""
    rules = "Follow the repo rules carefully. " + "Run the tests before you commit. " * 20
    log = one_line_log(lambda i, h: f"You are a coding agent for user {h}. {rules}")
    learner, reports = two_pass(log)
    assert len({r.family for r in reports}) == 1
    for h, b, report in zip(HANDLES, log, reports, strict=True):
        assert values(report) == {h: ("PL008", 1.0, "warning")}
        text = b["messages"][0]["content"]
        assert report.cacheable_tokens < report.prompt_tokens // 4  # the prefix ends at h
        fixed = rewrite_request(b, report=report, learner=learner).body
        assert h not in fixed["messages"][0]["content"]
        assert h in fixed["messages"][-1]["content"] and rules.strip() in text


def test_two_values_far_apart_on_one_line_are_two_spans() -> None:
    """A timestamp at a line's start and a handle near its end: both are reported and both
    moved, and the stable words between them stay; before, the line's changes were one span
    from the first to the last, the timestamp's pattern span took it over and the handle
    was neither reported nor moved (fix's estimate counted a prefix that still broke)."""
    middle = "You are a coding agent for the payments team, working for user"
    log = one_line_log(lambda i, h: f"Current time: 2026-12-02T10:0{i}:00Z. {middle} {h}. "
                                    "Follow the repo rules carefully.")
    learner, reports = two_pass(log)
    for i, (h, b, report) in enumerate(zip(HANDLES, log, reports, strict=True)):
        stamp = f"2026-12-02T10:0{i}:00Z"
        assert values(report) == {stamp: ("PL001", 1.0, "error"), h: ("PL008", 1.0, "warning")}
        system = rewrite_request(b, report=report, learner=learner).body["messages"][0]["content"]
        assert stamp not in system and h not in system and middle in system


USERS = ["user_44cb63", "user_204f89", "user_829868", "user_3c5fd7"]
AGENT = ("You are TravelBot, a helpful travel agent for Acme Corp. Always be concise and cite "
         "prices in EUR.")


def sessions_log(system: Any, turns: int = 3) -> list[dict[str, Any]]:
    """One session per user id, `turns` requests each (history appended turn by turn), all
    of one session first: the system prompt is `system(session, turn, user id)`."""
    log = []
    for s, uid in enumerate(USERS):
        for t in range(turns):
            history: list[dict[str, Any]] = [
                {"role": "user", "content": f"Question 0 for session {s}: find flights"}]
            for k in range(t):
                history += [{"role": "assistant", "content": "ok"},
                            {"role": "user", "content": f"Question {k + 1} for session {s}"}]
            log.append({"model": "gpt-4o", "messages": [
                {"role": "system", "content": system(s, t, uid)}, *history]})
    return log


@pytest.mark.parametrize("system", [
    lambda s, t, uid: f"[uid={uid}] {AGENT}",
    lambda s, t, uid: f"User: {uid}. {AGENT}",
    lambda s, t, uid: f"{AGENT} Signed in as {uid}.",
], ids=["bracketed-label-first", "label-first", "at-the-end"])
def test_a_user_id_anywhere_in_a_one_line_prompt_is_session_scoped(system: Any) -> None:
    """The naive reading of the log: the sessions' system prompts differ only by the user
    id, which is the same in every turn of a session. So they are one family, the id (and
    only the id, not its `uid=` label) is the one finding, PL013, in every request, and the
    cacheable prefix ends where the id starts. Before, an id in a line's first or last 32
    characters changed two of the line's three hashes, each session founded its own family,
    nothing was seen to vary, and the whole prompt counted as cacheable."""
    log = sessions_log(system)
    _, reports = two_pass(log)
    assert len({r.family for r in reports}) == 1
    for b, report in zip(log, reports, strict=True):
        text = b["messages"][0]["content"]
        uid = next(u for u in USERS if u in text)
        assert text.replace(uid, "ID") == system(0, 0, "ID")  # the naive reading holds
        assert values(report) == {uid: ("PL013", 1.0, "error")}
        (found,) = report.findings
        assert text[found.start:found.end] == uid
        assert report.cacheable_tokens == found.token_offset < report.prompt_tokens


@pytest.mark.parametrize("system", [
    lambda s, t, uid: f"[uid={uid}] Current time: {STAMP(s, t)}. {AGENT}",
    lambda s, t, uid: f"Current time: {STAMP(s, t)}. Serving [uid={uid}]. {AGENT}",
], ids=["id-first", "id-in-the-middle"])
def test_a_session_id_keeps_its_scope_beside_a_per_request_timestamp(system: Any) -> None:
    """A timestamp that changes every turn and an id that changes every session, on one
    line. Before, session evidence was kept per line, so the timestamp's change inside each
    session made the id a per-request value (PL008, a warning, which fix leaves in place),
    and the id's span held its stable `uid=` label (and with the id first, the sessions were
    not even one family)."""
    log = sessions_log(system)
    _, reports = two_pass(log)
    assert len({r.family for r in reports}) == 1
    for i, (b, report) in enumerate(zip(log, reports, strict=True)):
        s, t = divmod(i, 3)
        uid, text = USERS[s], b["messages"][0]["content"]
        assert text.replace(uid, "ID").replace(STAMP(s, t), "TS") == system(0, 0, "ID").replace(
            STAMP(0, 0), "TS")  # the naive reading: the id and the time differ, nothing else
        assert values(report) == {uid: ("PL013", 1.0, "error"),
                                  STAMP(s, t): ("PL001", 1.0, "error")}


def STAMP(session: int, turn: int) -> str:  # noqa: N802 (reads as a constant in the prompts)
    return f"2026-05-0{session + 1}T10:{turn:02d}:00Z"


def test_the_library_lints_a_lone_surrogate_like_other_text() -> None:
    """The CLI refuses a line with a lone surrogate escape (as the gateway does); a library
    caller's dict may still hold one, and the family id's hash raised UnicodeEncodeError on
    it. It is hashed as it is (`surrogatepass`), like the session fingerprint and the pairs."""
    log = sessions_log(lambda s, t, uid: f"Current time: {STAMP(s, t)}\ud800. {AGENT} {uid}")
    learner, reports = two_pass(log)
    assert len({r.family for r in reports}) == 1
    assert all(STAMP(i // 3, i % 3) in values(r) for i, r in enumerate(reports))
    fixed = rewrite_request(log[-1], report=reports[-1], learner=learner).body
    assert "\ud800" in fixed["messages"][0]["content"]
