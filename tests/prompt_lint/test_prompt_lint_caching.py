"""Cross-request memos change nothing: the cached path equals the uncached path.

Reference: the same calls with `set_caching(False)` (every memo bypassed:
JSON texts, tool sets, chunk tokens, line spans, piece reuse, masked lines),
and for the detector prefilter a plain run of every pattern.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import prompt_lint.lint as lint_module
from prompt_lint import TemplateLearner, learn_request, lint_request, rewrite_request
from prompt_lint.checks import min_cacheable_tokens
from prompt_lint.detectors import DETECTORS, Span, _detect_line
from prompt_lint.layout import estimate, layout_of, rule_layout
from prompt_lint.memo import LRU, compact_json_cached, set_caching
from prompt_lint.providers import segments, tool_description_path, tool_name
from prompt_lint.tokens import DEFAULT_ENCODING, TokenCounter, shared_counter
from prompt_lint.toolset import keys_sorted, tool_schema, tool_set

from .lint_corpus import CorpusRequest


def _online(corpus: list[CorpusRequest]) -> list[tuple[Any, ...]]:
    learner = TemplateLearner()
    out = []
    for req in corpus:
        report = lint_request(req.body, learner=learner)
        result = rewrite_request(req.body, report=report, learner=learner)
        out.append((report, json.dumps(result.body), result.moved))
    return out


def _two_pass(corpus: list[CorpusRequest]) -> list[Any]:
    learner = TemplateLearner()
    for req in corpus:
        learn_request(req.body, learner)
    learner.freeze()
    return [lint_request(req.body, learner=learner) for req in corpus]


def test_online_lint_and_rewrite_equal_uncached(corpus: list[CorpusRequest],
                                                online: Any) -> None:
    cached = _online(corpus)
    warm = _online(corpus)  # every memo is warm now
    set_caching(False)
    try:
        plain = _online(corpus)
    finally:
        set_caching(True)
    assert [r[0] for r in plain] == online.reports
    assert cached == plain
    assert warm == plain
    assert sum(len(r[0].findings) for r in plain) > 0


def test_a_layout_given_by_a_caller_that_encoded_the_segments_lints_the_same(
        corpus: list[CorpusRequest], online: Any) -> None:
    """The gateway hands lint the layout its shadow tokenized (every segment encoded whole):
    the reports equal those of lint's own layout (counted piece by piece), request by request
    through one learner each."""
    counter = shared_counter()
    learner = TemplateLearner()
    given = []
    for req in corpus:
        segs = segments(req.body, req.provider)
        layout = layout_of(segs, [len(counter.encode(s.text)) for s in segs])
        given.append(lint_request(req.body, learner=learner, layout=layout))
    assert given == online.reports
    assert sum(len(r.findings) for r in given) > 0


def test_a_body_the_caller_validated_lints_the_same(
        corpus: list[CorpusRequest], online: Any) -> None:
    """The gateway's parsers check a body more strictly than prompt_lint does and say so
    (`validated=True`): prompt_lint's own check is skipped, and the reports are those of the
    checking path, request by request through one learner."""
    learner = TemplateLearner()
    reports = [lint_request(req.body, learner=learner, validated=True) for req in corpus]
    assert reports == online.reports
    assert sum(len(r.findings) for r in reports) > 0


def test_a_validated_body_linted_with_its_layout_uses_the_layouts_tool_set(
        corpus: list[CorpusRequest], online: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's layout carries the ToolSet its segments were made with: a validated
    body linted with that layout does not look its tool list up again, and the reports are
    those of the checking path."""
    counter = shared_counter(DEFAULT_ENCODING)
    assert counter is shared_counter()  # one counter whether or not the name is given
    made = []
    for req in corpus:
        toolset = tool_set(req.body.get("tools") or [])
        segs = segments(req.body, req.provider, toolset)
        made.append(layout_of(segs, [len(counter.encode(s.text)) for s in segs], toolset))
    looked_up = []
    monkeypatch.setattr(lint_module, "tool_set",
                        lambda tools: looked_up.append(tools) or tool_set(tools))
    learner = TemplateLearner()
    reports = [lint_request(req.body, learner=learner, layout=layout, validated=True)
               for req, layout in zip(corpus, made, strict=True)]
    assert looked_up == []
    assert reports == online.reports
    assert sum(len(r.findings) for r in reports) > 0


def test_a_layout_that_estimates_new_messages_finds_the_same_rule_ids(
        corpus: list[CorpusRequest], online: Any) -> None:
    """The gateway's report-mode lint lays a body out with `rule_layout`: the messages past
    the provider's minimum are estimated, neither tokenized nor looked up (its shadow
    tokenizes the new ones after the answer, as `encode_cached` does here). Request by request
    through one learner, the rule ids are those of the exact layout's reports, PL010
    included, and every message segment past `exact` holds its estimate."""
    counter = TokenCounter(DEFAULT_ENCODING)  # nothing tokenized yet
    learner = TemplateLearner()
    estimated = with_pl010 = 0
    for req, exact in zip(corpus, online.reports, strict=True):
        model = req.body.get("model")
        layout = rule_layout(req.body, req.provider, counter,
                             min_cacheable_tokens(req.provider, model))
        report = lint_request(req.body, learner=learner, layout=layout)
        assert _ids(report) == _ids(exact)
        if layout.exact is not None:
            estimated += 1
            assert layout.exact >= min_cacheable_tokens(req.provider, model)
            assert req.provider == "openai"
            with_pl010 += "PL010" in _ids(report)
            past = [(seg, n) for seg, n, at in zip(layout.segments, layout.sizes,
                                                   layout.starts, strict=True)
                    if at >= layout.exact and not seg.scan]
            assert past and all(n == estimate(seg.text) for seg, n in past)
        for seg in layout.segments:  # the shadow's tokens, after the answer
            counter.encode_cached(seg.text)
    assert estimated > 20 and with_pl010 > 10


def test_a_prefix_below_the_minimum_is_counted_whole() -> None:
    """Below the minimum nothing is estimated: PL010's threshold depends on every count."""
    counter = TokenCounter(DEFAULT_ENCODING)
    body = {"model": "m", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "word " * 50},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more " * 400}]}
    layout = rule_layout(body, "openai", counter, 1024)
    assert layout.exact is None
    assert layout.sizes == TokenCounter(DEFAULT_ENCODING).count_segments(layout.segments)


def _ids(report: Any) -> set[str]:
    return {f.rule for f in report.findings}


def test_two_pass_equals_uncached(corpus: list[CorpusRequest]) -> None:
    part = corpus[:90]  # the uncached path tokenizes everything: keep it short
    cached = _two_pass(part)
    set_caching(False)
    try:
        plain = _two_pass(part)
    finally:
        set_caching(True)
    assert cached == plain
    assert any(r.findings for r in plain)


def test_segments_equal_uncached(corpus: list[CorpusRequest]) -> None:
    cached = [segments(r.body, r.provider) for r in corpus]
    set_caching(False)
    try:
        plain = [segments(r.body, r.provider) for r in corpus]
    finally:
        set_caching(True)
    assert cached == plain


def _naive_detect(line: str) -> list[Span]:
    """Every detector, no prefilter (the definition _detect_line must keep)."""
    taken: list[tuple[int, int]] = []
    spans: list[Span] = []
    for det in DETECTORS:
        for m in det.pattern.finditer(line):
            if det.valid is not None and not det.valid(m):
                continue
            start, end = m.span(det.group)
            if any(start < e and s < end for s, e in taken):
                continue
            taken.append((start, end))
            spans.append(Span(det.kind, start, end, line[start:end], det.label))
    spans.sort(key=lambda s: s.start)
    return spans


def _corpus_lines(corpus: list[CorpusRequest]) -> list[str]:
    lines = set()
    for req in corpus:
        for seg in segments(req.body, req.provider):
            lines.update(seg.text.split("\n"))
    return sorted(lines)


def test_prefilter_keeps_every_detection(corpus: list[CorpusRequest]) -> None:
    lines = _corpus_lines(corpus)
    found = [_detect_line(line) for line in lines]
    assert found == [_naive_detect(line) for line in lines]
    assert sum(map(len, found)) > 50


_LINE = st.lists(st.sampled_from(
    ["2026-11-29T14:03:07Z", "29/11/2026 14:03", "Mon, 29 Nov 2026 14:03:07 +0000",
     "Monday, November 29, 2026", "at 9:30 PM", "1764424987", "1764424987123",
     "user_id: u_42", "nonce=9fK2pQ7xLm3Nv8Rt5Wy1Zb4Hc", "sk-proj-abcdefghijklmnopqrst",
     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijkl", "a@b.example.com",
     "deadbeef-dead-beef-dead-beefdeadbeef", "Request #12", "v1.2.3", "x", " ", "-", ":",
     "#", "=", "/", ".", "١٢:٣٠", "AbCdEfGhIjKlMnOpQrStUv", "0123456789abcdef0123"]),
    max_size=8).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_LINE, st.text(max_size=80)))
def test_prefilter_property(line: str) -> None:
    assert _detect_line(line) == _naive_detect(line)


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=12))
def test_compact_json_memo_is_exact(value: Any) -> None:
    for _ in range(2):  # miss, then hit
        assert compact_json_cached(value) == json.dumps(value, ensure_ascii=False,
                                                        separators=(",", ":"))


def test_compact_json_memo_tells_look_alikes_apart() -> None:
    for a, b in [({"a": 1, "b": 2}, {"b": 2, "a": 1}), ([1], [True]), ([1.0], [1]),
                 ({"x": 0.0}, {"x": -0.0}), ({"1": 1}, {1: 1})]:
        assert compact_json_cached(a) == json.dumps(a, ensure_ascii=False, separators=(",", ":"))
        assert compact_json_cached(b) == json.dumps(b, ensure_ascii=False, separators=(",", ":"))


def test_tool_set_matches_direct_computation(corpus: list[CorpusRequest]) -> None:
    for req in corpus:
        tools = req.body.get("tools") or []
        for _ in range(2):
            ts = tool_set(tools)
            assert ts.names == tuple(tool_name(t, req.provider) for t in tools)
            assert [s.text for s in ts.segments] == [
                json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools]
            assert [(s.path, s.text) for s in ts.descriptions] == [
                d for i, t in enumerate(tools) if (d := tool_description_path(t, i))]
            assert ts.schema_sorted == tuple(keys_sorted(tool_schema(t)) for t in tools)


def test_lru_respects_both_caps() -> None:
    memo: LRU[str, str] = LRU(3, max_weight=10)
    for key in "abcd":
        memo.put(key, key.upper(), 2)
    assert len(memo) == 3 and memo.get("a") is None and memo.get("d") == "D"
    memo.get("b")  # b is now the most recent
    memo.put("e", "E", 7)  # over the weight cap: the oldest entries go first
    assert memo.weight <= 10
    assert memo.get("e") == "E" and memo.get("c") is None
    memo.put("huge", "H", 11)  # heavier than the whole cap: not stored
    assert memo.get("huge") is None
    with pytest.raises(ValueError):
        LRU(0)
