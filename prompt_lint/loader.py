"""Reading request logs: JSONL, a single JSON file (object or array), or a directory.

Everything is read and validated before anything is linted, so bad input
gives one clear error (file, line, problem) and no partial report.
A log record may be the request body itself or an envelope holding it under
`body` or `request`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple, cast

from prompt_lint.providers import PROVIDERS, Provider, RequestError, detect_provider, validate


class InputError(ValueError):
    """Unreadable or invalid input; the message names the file and line."""


class LoadedRequest(NamedTuple):
    """One request from a log: where it came from, its body and provider."""

    source: str
    line: int
    body: dict[str, Any]
    provider: Provider


def load_requests(paths: list[str], provider: str | None = None) -> list[LoadedRequest]:
    """All requests in `paths` ("-" is stdin), in order, validated."""
    if provider is not None and provider not in PROVIDERS:
        raise InputError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    out: list[LoadedRequest] = []
    for path in paths:
        for source, text in _texts(path):
            for line, record in _records(source, text):
                out.append(_request(source, line, record, provider))
    if not out:
        raise InputError(f"no requests found in {', '.join(paths)}")
    return out


def _texts(path: str) -> list[tuple[str, str]]:
    if path == "-":
        return [("<stdin>", sys.stdin.read())]
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in {".json", ".jsonl"} and f.is_file())
        return [(str(f), _read(f)) for f in files]
    if not p.exists():
        raise InputError(f"{path}: no such file or directory")
    return [(path, _read(p))]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from exc


def _records(source: str, text: str) -> list[tuple[int, Any]]:
    stripped = text.strip()
    if not stripped:
        return []
    if stripped[0] in "[{":
        try:
            whole = json.loads(stripped)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, list):
            return [(1, record) for record in whole]
        if whole is not None:
            return [(1, whole)]
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise InputError(f"{source}:{n}: invalid JSON: {exc.msg} (column {exc.colno})") \
                from exc
    return out


def _request(source: str, line: int, record: Any, provider: str | None) -> LoadedRequest:
    if isinstance(record, dict) and "messages" not in record:
        for key in ("body", "request"):
            if isinstance(record.get(key), dict):
                record = record[key]
                break
    try:
        prov = cast(Provider, provider) if provider is not None else detect_provider(record)
        validate(record, prov)
    except RequestError as exc:
        raise InputError(f"{source}:{line}: {exc}") from exc
    return LoadedRequest(source, line, record, prov)
