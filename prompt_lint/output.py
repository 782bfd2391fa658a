"""Report formats: text for people, JSON for programs, SARIF for code-scanning UIs, GitHub
Actions workflow commands (annotations on the log's lines in a run's summary and diff)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import PurePosixPath
from typing import Any, NamedTuple, Protocol
from urllib.parse import quote

from prompt_lint.loader import Skipped
from prompt_lint.rules import RULES
from prompt_lint.types import Finding, LintReport, mask_value

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
_GITHUB_LEVEL = {"error": "error", "warning": "warning", "info": "notice"}


class Located(Protocol):
    """Where a request was read (a `LoadedRequest`, or a `Where` that holds no body)."""

    @property
    def source(self) -> str: ...

    @property
    def line(self) -> int: ...


class Where(NamedTuple):
    """A request's file and line, all a report needs of it (its body is not kept)."""

    source: str
    line: int


class Summary(NamedTuple):
    """Totals over a log: counts and the prompt-token share that is cacheable."""

    requests: int
    findings: int
    by_severity: dict[str, int]
    by_rule: dict[str, int]
    prompt_tokens: int
    cacheable_tokens: int
    cacheable_tokens_after_fix: int

    @property
    def hit_rate_now(self) -> float:
        """Cacheable share of prompt tokens as sent."""
        return self.cacheable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate_after_fix(self) -> float:
        """Cacheable share of prompt tokens after `prefixgate fix`."""
        return self.cacheable_tokens_after_fix / self.prompt_tokens if self.prompt_tokens else 0.0


def summarize(reports: list[LintReport]) -> Summary:
    """Totals over all reports."""
    findings = [f for r in reports for f in r.findings]
    return Summary(len(reports), len(findings), dict(Counter(f.severity for f in findings)),
                   dict(sorted(Counter(f.rule for f in findings).items())),
                   sum(r.prompt_tokens for r in reports), sum(r.cacheable_tokens for r in reports),
                   sum(r.cacheable_tokens_after_fix for r in reports))


def to_json(requests: Sequence[Located], reports: list[LintReport],
            show_values: bool, skipped: Sequence[Skipped] = ()) -> dict[str, Any]:
    """The `--format json` document (schema in the README); `skipped` (records left out by
    `--skip-invalid`) is there only when there are some."""
    s = summarize(reports)
    left_out = {"skipped": [{"source": k.source, "line": k.line, "problem": k.message}
                            for k in skipped]} if skipped else {}
    return {
        "requests": [_request_json(i, req, rep, show_values)
                     for i, (req, rep) in enumerate(zip(requests, reports, strict=True))],
        "summary": {"requests": s.requests, "findings": s.findings,
                    "by_severity": s.by_severity, "by_rule": s.by_rule,
                    "prompt_tokens": s.prompt_tokens, "cacheable_tokens": s.cacheable_tokens,
                    "cacheable_tokens_after_fix": s.cacheable_tokens_after_fix,
                    "hit_rate_now": round(s.hit_rate_now, 4),
                    "hit_rate_after_fix": round(s.hit_rate_after_fix, 4)},
        **left_out,
    }


def _request_json(i: int, req: Located, rep: LintReport, show: bool) -> dict[str, Any]:
    return {"index": i, "source": req.source, "line": req.line, "provider": rep.provider,
            "family": rep.family, "findings": [f.to_json(show) for f in rep.findings],
            "prompt_tokens": rep.prompt_tokens, "cacheable_tokens": rep.cacheable_tokens,
            "cacheable_tokens_after_fix": rep.cacheable_tokens_after_fix}


def to_text(requests: Sequence[Located], reports: list[LintReport], show_values: bool) -> str:
    """Per-request findings (clean requests skipped), then a summary."""
    lines: list[str] = []
    for i, (req, rep) in enumerate(zip(requests, reports, strict=True)):
        if not rep.findings:
            continue
        lines.append(f"request {i} ({req.source}:{req.line}, {rep.provider}, family "
                     f"{rep.family or '-'}): {rep.prompt_tokens} tokens, cacheable prefix "
                     f"{rep.cacheable_tokens} -> {rep.cacheable_tokens_after_fix} after fix")
        lines += [_finding_line(f, show_values) for f in rep.findings]
    return "\n".join(lines + _summary_lines(reports)) + "\n"


def _summary_lines(reports: list[LintReport]) -> list[str]:
    s = summarize(reports)
    sev = ", ".join(f"{k} {s.by_severity.get(k, 0)}" for k in ("error", "warning", "info"))
    rules = ", ".join(f"{k} {v}" for k, v in s.by_rule.items()) or "none"
    change = (s.hit_rate_after_fix - s.hit_rate_now) * 100
    return [f"summary: {s.requests} requests, {s.findings} findings ({sev})",
            f"  by rule: {rules}",
            f"  cacheable prefix: {s.hit_rate_now:.1%} of prompt tokens now, "
            f"{s.hit_rate_after_fix:.1%} after fix "
            f"(expected hit-rate change {change:+.1f} points)"]


def _finding_line(f: Finding, show: bool) -> str:
    where = f.path + (f":{f.start}-{f.end}" if f.start is not None else "")
    token = f" @token {f.token_offset}" if f.token_offset is not None else ""
    value = f.value if show else mask_value(f.value, f.kind)
    sure = f" (confidence {f.confidence:.2f})" if f.confidence < 1.0 else ""
    return f"  {f.severity:<7} {f.rule} {f.name:<24} {where}{token}: {f.message}{sure}" + \
        (f" [{value}]" if value else "")


def to_sarif(requests: Sequence[Located], reports: list[LintReport],
             show_values: bool, skipped: Sequence[Skipped] = ()) -> dict[str, Any]:
    """A SARIF 2.1.0 log: one result per finding, located at the log line; records left out
    by `--skip-invalid` are the invocation's error notifications, at their lines."""
    rules = [{"id": r.id, "name": r.name, "shortDescription": {"text": r.name},
              "fullDescription": {"text": r.explanation}, "help": {"text": r.fix},
              "defaultConfiguration": {"level": _SARIF_LEVEL[r.severity]},
              "properties": {"kind": r.kind}} for r in RULES.values()]
    results = [_sarif_result(i, req, f, show_values)
               for i, (req, rep) in enumerate(zip(requests, reports, strict=True))
               for f in rep.findings]
    driver = {"name": "prefixgate-lint", "informationUri": "https://example.invalid/prefixgate",
              "rules": rules}
    run: dict[str, Any] = {"tool": {"driver": driver}, "results": results}
    if skipped:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": [
            {"level": "error", "message": {"text": k.message},
             "locations": [{"physicalLocation": {"artifactLocation": {"uri": sarif_uri(k.source)},
                                                 "region": {"startLine": k.line}}}]}
            for k in skipped]}]
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


def sarif_uri(source: str) -> str:
    """An input's name as SARIF's `artifactLocation.uri`, a URI reference: a relative path
    percent-encoded (a space or `#` in a file name, `<stdin>`, were written raw: not a URI,
    and `#` began a fragment), an absolute one as a `file://` URI (a bare `/home/...` reads as
    relative to the repository in code-scanning uploads)."""
    if PurePosixPath(source).is_absolute():
        return "file://" + quote(source)
    return quote(source)


def _sarif_result(i: int, req: Located, f: Finding, show: bool) -> dict[str, Any]:
    value = f.value if show else mask_value(f.value, f.kind)
    text = f.message + (f" [{value}]" if value else "")
    return {"ruleId": f.rule, "level": _SARIF_LEVEL[f.severity], "message": {"text": text},
            "locations": [{
                "physicalLocation": {"artifactLocation": {"uri": sarif_uri(req.source)},
                                     "region": {"startLine": req.line}},
                "logicalLocations": [{"fullyQualifiedName": f"requests[{i}].{f.path}".rstrip("."),
                                      "kind": "member"}]}],
            "properties": {"kind": f.kind, "start": f.start, "end": f.end,
                           "tokenOffset": f.token_offset, "confidence": f.confidence}}


def to_github(requests: Sequence[Located], reports: list[LintReport],
              show_values: bool) -> str:
    """One `::error file=F,line=N,title=T::message` workflow command per finding (warning and
    notice for the other severities), escaped as GitHub Actions reads them, then the text
    report's summary lines."""
    lines = []
    for req, rep in zip(requests, reports, strict=True):
        for f in rep.findings:
            value = f.value if show_values else mask_value(f.value, f.kind)
            where = f.path + (f":{f.start}-{f.end}" if f.start is not None else "")
            text = (f"{where}: " if where else "") + f.message + (f" [{value}]" if value else "")
            lines.append(f"::{_GITHUB_LEVEL[f.severity]} file={_github_property(req.source)},"
                         f"line={req.line},title={_github_property(f'{f.rule} {f.name}')}"
                         f"::{_github_data(text)}")
    return "\n".join(lines + _summary_lines(reports)) + "\n"


def _github_data(text: str) -> str:
    """A workflow command's message, escaped (`%`, CR and LF)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _github_property(text: str) -> str:
    """A workflow command's property value, escaped (also `:` and `,`, which end it)."""
    return _github_data(text).replace(":", "%3A").replace(",", "%2C")


def render(fmt: str, requests: Sequence[Located], reports: list[LintReport],
           show_values: bool, skipped: Sequence[Skipped] = ()) -> str:
    """The report in format `fmt` (text, json, sarif or github); a text or github report
    leaves the skipped records to stderr (`prefixgate lint` names them there)."""
    if fmt == "text":
        return to_text(requests, reports, show_values)
    if fmt == "github":
        return to_github(requests, reports, show_values)
    doc = to_json(requests, reports, show_values, skipped) if fmt == "json" else \
        to_sarif(requests, reports, show_values, skipped)
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def render_pieces(fmt: str, requests: Sequence[Located], reports: list[LintReport],
                  show_values: bool, skipped: Sequence[Skipped] = ()) -> Iterator[str]:
    """`render`'s text in pieces, to be written as they come: an indented JSON document is
    encoded in millions of small pieces, which `json.dumps` holds all at once (with the
    joined text and its bytes, several times the report: 150 MB for a 200 MB log's)."""
    if fmt in ("text", "github"):
        yield render(fmt, requests, reports, show_values, skipped)
        return
    doc = to_json(requests, reports, show_values, skipped) if fmt == "json" else \
        to_sarif(requests, reports, show_values, skipped)
    yield from json.JSONEncoder(indent=2, ensure_ascii=False).iterencode(doc)
    yield "\n"
