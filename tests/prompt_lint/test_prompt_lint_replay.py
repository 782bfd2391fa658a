"""Raw vs rewritten vs ideal sessions replayed through a prefix cache (tiktoken tokens).

The rewritten log must reach >= 90% of the hit rate of the ideal layout the
corpus generator wrote. Hit rates come from `radix_cache.RadixCache` and are
checked against a naive page-prefix set.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from prompt_lint import TemplateLearner, request_tokens, rewrite_request
from prompt_lint.lint import lint_request
from prompt_lint.providers import detect_provider, validate

from .lint_linted import Linted

PAGE = 16


def naive_hit_rate(logs: list[list[int]], page: int = PAGE) -> float:
    """Reference: a set of every cached page-aligned prefix (hash chain of pages)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    hit = total = 0
    for tokens in logs:
        key, matching = 0, True
        for start in range(0, len(tokens) - page + 1, page):
            node = (key, tuple(tokens[start:start + page]))
            if matching and node in seen:
                hit += page
            else:
                matching = False
                seen.add(node)
            key = hash(node)
        total += len(tokens)
    return hit / total


def radix_hit_rate(logs: list[list[int]], page: int = PAGE) -> float:
    radix_cache = pytest.importorskip("radix_cache")
    cache = radix_cache.RadixCache(page)
    hit = total = 0
    for tokens in logs:
        hit += cache.match(tokens).length
        cache.insert(tokens, None)
        total += len(tokens)
    return hit / total


@pytest.fixture(scope="module")
def rewritten(two_pass: Linted) -> list[dict[str, Any]]:
    """`prefixgate fix`: rewrite each request with the report and learner that linted it."""
    learner = TemplateLearner()
    from prompt_lint import learn_request

    for req in two_pass.corpus:
        learn_request(req.body, learner)
    learner.freeze()
    out = []
    for req in two_pass.corpus:
        report = lint_request(req.body, learner=learner)
        out.append(rewrite_request(req.body, report=report, learner=learner).body)
    return out


def test_rewritten_reaches_ideal_hit_rate(two_pass: Linted,
                                          rewritten: list[dict[str, Any]]) -> None:
    raw = [request_tokens(r.body) for r in two_pass.corpus]
    ideal = [request_tokens(r.ideal) for r in two_pass.corpus]
    fixed = [request_tokens(b) for b in rewritten]
    rates = {name: (naive_hit_rate(logs), radix_hit_rate(logs))
             for name, logs in (("raw", raw), ("rewritten", fixed), ("ideal", ideal))}
    print({k: round(v[0], 4) for k, v in rates.items()})
    for naive, radix in rates.values():
        assert naive == pytest.approx(radix, abs=1e-12)
    assert rates["rewritten"][0] >= 0.9 * rates["ideal"][0], rates
    assert rates["raw"][0] < 0.5 * rates["ideal"][0], rates


def test_every_moved_value_survives(two_pass: Linted) -> None:
    """Each moved value and each injected value is still in the rewritten request."""
    moved = 0
    for req, rep in zip(two_pass.corpus, two_pass.reports, strict=True):
        result = rewrite_request(req.body, report=rep)
        text = json.dumps(result.body, ensure_ascii=False)
        for value in result.moved:
            assert json.dumps(value, ensure_ascii=False)[1:-1] in text, value
            moved += 1
        for label in req.labels:
            assert label.value.rstrip(".") in text, label
    assert moved > 500


def test_rewritten_requests_are_valid_and_same_provider(two_pass: Linted,
                                                        rewritten: list[dict[str, Any]]) -> None:
    for req, body in zip(two_pass.corpus, rewritten, strict=True):
        provider = detect_provider(req.body)
        assert detect_provider(body) == provider
        validate(body, provider)
        assert set(body) == set(req.body)
        if provider == "anthropic":
            _check_anthropic(body)
        names = [t.get("name") or t["function"]["name"] for t in body["tools"]]
        assert names == sorted(names)
        assert json.dumps(body["tools"]) == json.dumps(body["tools"], sort_keys=True)


def _check_anthropic(body: dict[str, Any]) -> None:
    roles = [m["role"] for m in body["messages"]]
    assert all(a != b for a, b in zip(roles, roles[1:], strict=False)), roles
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, list):
            types = [b["type"] for b in content]
            if "tool_result" in types:  # tool results first, as the API requires
                assert types == sorted(types, key=lambda t: t != "tool_result"), types


def test_rewritten_sessions_only_grow(two_pass: Linted,
                                      rewritten: list[dict[str, Any]]) -> None:
    """Across one session, each rewritten request extends the previous one's messages."""
    last: dict[str, list[Any]] = {}
    extended = 0
    for req, body in zip(two_pass.corpus, rewritten, strict=True):
        if "PL009" in req.structural:  # the client edited history itself
            last.pop(req.session, None)
        before = last.get(req.session)
        messages = body["messages"]
        if before is not None:
            prior = before[:-1] if before[-1]["role"] in {"user", "tool"} else before
            assert messages[: len(prior)] == prior
            extended += 1
        last[req.session] = messages
    assert extended > 100


def test_rewrite_is_deterministic(two_pass: Linted) -> None:
    for req in two_pass.corpus[:40]:
        a = rewrite_request(req.body, report=lint_request(req.body))
        b = rewrite_request(json.loads(json.dumps(req.body)), report=lint_request(req.body))
        assert json.dumps(a.body) == json.dumps(b.body)
        assert a.changed == (a.body != req.body)
