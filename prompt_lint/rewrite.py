"""rewrite_request: the same request, stable parts first, dynamic parts last.

Dynamic spans (timestamps, identifiers, nonces, learned spans) found in the
template material are replaced by a stable marker `[context:<kind>_<n>]` and
their values listed in one context block at the start of the last user turn
(after the tool results of an Anthropic tool-result turn, where the API
requires those first; at its end when it is the first user message and the
family's sessions share its text, below which the block must go). Tools are
sorted by name and their JSON keys sorted; an Anthropic tool-list breakpoint
stays on the last tool. Every value is kept.

With a learner, its SessionTracker remembers the context block each message
received, keyed by the rewritten conversation before it (breakpoints left
out) and by the moved identifiers of the request, so when that turn comes back
as history it gets the same block, is emitted with the same content, and the
cached prefix only grows.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from prompt_lint.checks import canonical_json
from prompt_lint.lint import MARKER_OPEN, context_target, is_moved, lint_request
from prompt_lint.opening import moved_to_end, opening_lines
from prompt_lint.providers import Provider, compact_json, detect_provider, tool_name
from prompt_lint.segment import without_breakpoints
from prompt_lint.session import SessionTracker, fingerprint
from prompt_lint.templates import TemplateLearner
from prompt_lint.types import Finding, LintReport, RewriteResult

_PATH_RE = re.compile(r"([A-Za-z_]+)|\[(\d+)\]")


def rewrite_request(body: dict[str, Any], provider: Provider | None = None,
                    report: LintReport | None = None,
                    learner: TemplateLearner | None = None) -> RewriteResult:
    """Rewrite `body` stable-first; see the module docstring.

    Pass the `report` lint_request gave for this body (with the same learner)
    to avoid linting twice; without one it is computed here.
    """
    prov = provider or detect_provider(body)
    if report is None:
        report = lint_request(body, prov, learner=learner)
    out = copy.deepcopy(body)
    moved = [f for f in report.findings if is_moved(f)]
    names = _replace_spans(out, moved)
    lifted = _move_opening_lines(out, report.findings)
    _canonical_tools(out, prov)
    context = "".join(f"{n}: {f.value}\n" for n, f in zip(names, moved, strict=True))
    block = f"<context>\n{context}</context>" if moved else ""
    tracker = learner.sessions if learner is not None else None
    _place_context(out, prov, block, moved, tracker, report.family, report.shared_opening)
    return RewriteResult(out, [f.value for f in moved] + lifted, out != body)


def _replace_spans(body: dict[str, Any], moved: list[Finding]) -> list[str]:
    """Put a marker where each moved value was; return the marker names in order."""
    counts: dict[str, int] = {}
    names = []
    for f in moved:
        counts[f.kind] = counts.get(f.kind, 0) + 1
        names.append(f"{f.kind}_{counts[f.kind]}")
    by_path: dict[str, list[tuple[Finding, str]]] = {}
    for f, name in zip(moved, names, strict=True):
        by_path.setdefault(f.path, []).append((f, name))
    for path, items in by_path.items():
        text = get_path(body, path)
        for f, name in sorted(items, key=lambda item: item[0].start or 0, reverse=True):
            assert f.start is not None and f.end is not None
            text = text[: f.start] + f"{MARKER_OPEN}{name}]" + text[f.end :]
        set_path(body, path, text)
    return names


def _move_opening_lines(body: dict[str, Any], findings: list[Finding]) -> list[str]:
    """Move the lines PL014 names to the end of their message (`opening.moved_to_end`: the
    text the lint compared across sessions; the same message in every turn of a session, so
    its history stays byte-identical); returns their values."""
    found = [f for f in findings if f.rule == "PL014" and f.start is not None]
    for path in {f.path for f in found}:
        text = get_path(body, path)
        set_path(body, path, moved_to_end(text, opening_lines(text, [f for f in found
                                                                     if f.path == path])))
    return [f.value for f in found]


def _keys(path: str) -> list[str | int]:
    return [name if name else int(index) for name, index in _PATH_RE.findall(path)]


def get_path(body: Any, path: str) -> Any:
    """The value at a finding path such as `messages[0].content[1].text`."""
    for key in _keys(path):
        body = body[key]
    return body


def set_path(body: Any, path: str, value: Any) -> None:
    """Replace the value at a finding path."""
    keys = _keys(path)
    for key in keys[:-1]:
        body = body[key]
    body[keys[-1]] = value


def _canonical_tools(body: dict[str, Any], provider: Provider) -> None:
    tools = body.get("tools")
    if not tools:
        return
    marker = tools[-1].get("cache_control") if isinstance(tools[-1], dict) else None
    ordered = sorted(tools, key=lambda t: tool_name(t, provider) or "")
    canonical = [json.loads(canonical_json({k: v for k, v in t.items() if k != "cache_control"}))
                 for t in ordered]
    for old, new in zip(ordered, canonical, strict=True):
        if old.get("cache_control") and old is not tools[-1]:
            new["cache_control"] = old["cache_control"]
    if marker is not None:
        canonical[-1]["cache_control"] = marker
    body["tools"] = canonical


def _place_context(body: dict[str, Any], provider: Provider, block: str, moved: list[Finding],
                   tracker: SessionTracker | None, family: str | None,
                   shared_opening: int | None = None) -> None:
    """The context block into the last user turn (at its start; at its end when that is the
    opening whose text the family's sessions share, so the block sits below that text), and
    into each history message the block it got as the last turn."""
    messages = body["messages"]
    target = context_target(body, provider)
    if block and target is None:
        messages.append({"role": "user", "content": block})
        return
    identity = sorted(f.value for f in moved if _identifies(f))
    running = fingerprint(family or "", *identity)
    values = _telling_values(moved)
    for i, message in enumerate(messages):
        key = fingerprint(running, _content_json(message))
        if i == target:
            if block:
                messages[i] = _with_context(message, block, provider, i == shared_opening)
            if tracker is not None:
                given = {"context": block}  # one object under every name (`_remembered`)
                for name in [key, *(fingerprint(key, v) for v in values)]:
                    tracker.remember(name, given)
        elif tracker is not None and target is not None and i < target:
            old = _remembered(tracker, key, values)
            if old is not None and old["context"]:
                messages[i] = _with_context(message, old["context"], provider,
                                            i == shared_opening)
        running = fingerprint(running, _content_json(messages[i]))


def _content_json(message: dict[str, Any]) -> str:
    """A message's JSON without its blocks' breakpoints: what a session's turns are known by.
    An Anthropic agent moves its breakpoint to the newest block every turn, so a turn comes
    back as history with its breakpoint gone; it is the same turn, and it gets the context
    block it got as the last turn, with the breakpoints where the client now puts them."""
    content = message.get("content")
    if not isinstance(content, list):
        return compact_json(message)
    return compact_json({**message, "content": [without_breakpoints(b) for b in content]})


#: Kinds of moved values, most telling of a session first; a timestamp tells none (it changes
#: every turn).
_TELLING = {"session": 0, "identifier": 1, "nonce": 2, "learned": 3}


def _telling_values(moved: list[Finding]) -> list[str]:
    """The moved values that may tell this request's session from another's, most telling
    first (see `_remembered`)."""
    kept = sorted({(_TELLING[f.kind], f.value) for f in moved if f.kind in _TELLING})
    return [value for _, value in kept]


def _remembered(tracker: SessionTracker, key: str, values: list[str]) -> dict[str, Any] | None:
    """The context block (`{"context": block}`) to give the history message remembered under
    `key`.

    Two conversations that open alike share `key` whenever nothing tells their sessions apart
    (a user id whose scope the family's evidence did not show: it varied "across requests"),
    and `key` holds the one rewritten last: interleaved in a log, or in one tenant's traffic,
    one user's history came back with another user's context block (their id, their time).
    So the block is also remembered under `key` with each of its request's telling values,
    and of what is found under this request's values and under `key` alone, the block that
    holds most of this request's values is given (a value-keyed one on a tie)."""
    found = [tracker.remembered(fingerprint(key, v)) for v in values]
    found.append(tracker.remembered(key))
    candidates = list({id(m): m for m in found if m is not None}.values())
    if len(candidates) < 2:  # one message (usually all keys hold it): nothing to weigh
        return candidates[0] if candidates else None
    return max(candidates, key=lambda m: _shared(m, values))


def _shared(message: dict[str, Any], values: list[str]) -> int:
    """How many of `values` the remembered block's JSON holds."""
    text = compact_json(message)
    return sum(v in text for v in values)


def _identifies(f: Finding) -> bool:
    """Values that tell one session's remembered turns from another's: session-scoped
    values, and identifiers with no evidence that they change inside a session."""
    return f.kind == "session" or (f.kind == "identifier" and f.confidence < 1.0)


def _with_context(message: dict[str, Any], block: str, provider: Provider,
                  at_end: bool = False) -> dict[str, Any]:
    """`message` with the context block at its start (after an Anthropic turn's tool results),
    or `at_end`."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, str) or content is None:
        if at_end and content:
            message["content"] = content + "\n\n" + block
        else:
            message["content"] = block + ("\n\n" + content if content else "")
        return message
    blocks = list(content)
    if at_end:
        message["content"] = [*blocks, {"type": "text", "text": block}]
        return message
    at = 0
    if provider == "anthropic":
        while at < len(blocks) and isinstance(blocks[at], dict) and \
                blocks[at].get("type") == "tool_result":
            at += 1
    blocks.insert(at, {"type": "text", "text": block})
    message["content"] = blocks
    return message
