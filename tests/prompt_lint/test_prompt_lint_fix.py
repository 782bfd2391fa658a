"""`prefixgate fix` output lints clean, is idempotent, and keeps history byte-identical.

Run as a user would: `prefixgate fix log.jsonl -o fixed.jsonl`, then lint and
fix the output again, over the labelled corpus and the held-out corpus. The
corpus's client-side history edits (PL009 in the raw log) are the only
error-level findings left: fix never rewrites what the client changed itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prompt_lint.cli import fix_main, lint_main

from .lint_corpus import CorpusRequest, build_corpus


def _fix(src: Path, dst: Path) -> list[dict[str, Any]]:
    assert fix_main([str(src), "-o", str(dst)]) == 0
    return [json.loads(line) for line in dst.read_text().splitlines()]


@pytest.fixture(scope="module", params=[(7, "train"), (11, "holdout")], ids=["train", "held-out"])
def fixed(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[list[CorpusRequest], Path, Path]:
    seed, phrasing = request.param
    corpus = build_corpus(seed=seed, phrasing=phrasing)
    tmp = tmp_path_factory.mktemp(f"fix-{phrasing}")
    raw = tmp / "raw.jsonl"
    raw.write_text("".join(json.dumps(r.body) + "\n" for r in corpus))
    _fix(raw, tmp / "fixed.jsonl")
    return corpus, raw, tmp / "fixed.jsonl"


def test_fix_is_idempotent(fixed: tuple[list[CorpusRequest], Path, Path],
                           tmp_path: Path) -> None:
    _, _, once = fixed
    _fix(once, tmp_path / "twice.jsonl")
    assert (tmp_path / "twice.jsonl").read_bytes() == once.read_bytes()


def test_lint_of_fix_has_no_error(fixed: tuple[list[CorpusRequest], Path, Path],
                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus, _, once = fixed
    capsys.readouterr()
    lint_main([str(once), "--format", "json", "--fail-on", "never"])
    doc = json.loads(capsys.readouterr().out)
    errors = [(r["index"], f["rule"]) for r in doc["requests"] for f in r["findings"]
              if f["severity"] == "error"]
    client_edits = [(k, "PL009") for k, req in enumerate(corpus) if "PL009" in req.structural]
    assert client_edits and errors == client_edits
    assert doc["summary"]["by_rule"].get("PL001", 0) == 0


def test_fix_keeps_earlier_turns_byte_identical(fixed: tuple[list[CorpusRequest], Path, Path]
                                                ) -> None:
    """Within a session each fixed request starts with the previous one's bytes: tools,
    system prompt and every earlier message (the context block stays where it was first
    placed); only the client's own edits break this."""
    corpus, _, once = fixed
    bodies = [json.loads(line) for line in once.read_text().splitlines()]
    last: dict[str, dict[str, Any]] = {}
    compared = 0
    for req, body in zip(corpus, bodies, strict=True):
        before = last.get(req.session)
        last[req.session] = body
        if before is None or "PL009" in req.structural:
            continue
        assert _dumps(body["tools"]) == _dumps(before["tools"])
        assert _dumps(body.get("system")) == _dumps(before.get("system"))
        old = [_dumps(m) for m in before["messages"]]
        assert [_dumps(m) for m in body["messages"][: len(old)]] == old
        compared += 1
    assert compared > 100


def test_fix_of_raw_log_is_not_clean_before(fixed: tuple[list[CorpusRequest], Path, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The reference point: the raw log has error-level dynamic findings in most requests."""
    corpus, raw, _ = fixed
    capsys.readouterr()
    assert lint_main([str(raw), "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    dirty = sum(any(f["severity"] == "error" and f["rule"] in {"PL001", "PL002", "PL013"}
                    for f in r["findings"]) for r in doc["requests"])
    assert dirty > 0.5 * len(corpus)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def test_build_corpus_holdout_differs() -> None:
    a = {json.dumps(r.body["messages"][0]) for r in build_corpus(seed=7)[:5]}
    b = {json.dumps(r.body["messages"][0]) for r in build_corpus(seed=11, phrasing="holdout")[:5]}
    assert not a & b
