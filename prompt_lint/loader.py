"""Reading request logs: JSONL, a single JSON file (object or array), or a directory.

Everything is read and validated before anything is linted, so bad input
gives one clear error (file, line, problem) and no partial report: bytes that
are not UTF-8, invalid JSON (`NaN`, `Infinity` and a number too large for a double,
such as `1e400`, are not JSON numbers: the standard library reads them as floats that
`fix` would write back as `NaN` / `Infinity`, which no JSON parser or provider accepts;
the gateway refuses them too), JSON nested deeper than `MAX_DEPTH` levels, a lone
UTF-16 surrogate escape (`"\ud800"`: not Unicode, so no encoder, upstream or
report can carry it; the gateway refuses such a body too), or a record that is
not a request. A log record may be the request body itself or an envelope
holding it under `body` or `request`. A lenient load (`skipped=` a list; `prefixgate lint
--skip-invalid`) leaves such a record out instead, noting where and why in that list, and
reads the rest: a log still being written ends in a half line, and a log of what an agent
sent may hold other records; an unreadable file or a missing path is still refused.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
import zlib
from pathlib import Path
from typing import Any, NamedTuple, cast

from prompt_lint.providers import PROVIDERS, Provider, RequestError, detect_provider, validate

#: Nesting a record may have. Far below the interpreter's recursion limit (a parse of
#: about 1000 levels overflowed it), so nothing that walks or serialises a record later
#: (compact JSON, canonical tool JSON) can; request bodies are a few levels deep.
MAX_DEPTH = 128
#: A UTF-16 surrogate escape in JSON text: only a line holding one can parse to a lone
#: surrogate (the text itself is valid UTF-8).
_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
#: JSON whitespace (what may stand between an array's elements and their commas).
_SPACE = re.compile(r"[ \t\n\r]*")
#: The byte order mark, as text: dropped at the start of an input.
BOM = "\ufeff"
#: Digits an integer may have: what the interpreter converts (0 there means no limit).
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 1 << 62


class InputError(ValueError):
    """Unreadable or invalid input; the message names the file and line."""


def _reject_constant(name: str) -> float:
    """`parse_constant` for json.loads: `NaN`, `Infinity`, `-Infinity` are not JSON."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """`parse_float` for json.loads: a number a double holds (`1e400` would become inf)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _bounded_int(text: str) -> int:
    """`parse_int` for json.loads: an integer the interpreter converts (its digit limit,
    4300 by default, raised a message that named a Python setting)."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"integer of {digits} digits is out of range")
    return int(text)


def _loads(text: str) -> Any:
    """`text` as strict JSON: the standard library's parse without its extensions."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                      parse_int=_bounded_int)


class Skipped(NamedTuple):
    """A record a lenient load left out: its file, its line and the problem (`message`: the
    whole `file:line: problem` line)."""

    source: str
    line: int
    message: str


def _skip(skipped: list[Skipped] | None, source: str, line: int, exc: InputError) -> None:
    """Note `exc` as a left-out record in `skipped`; re-raise it for a strict load (None)."""
    if skipped is None:
        raise exc
    skipped.append(Skipped(source, line, str(exc)))


class LoadedRequest(NamedTuple):
    """One request from a log: where it came from, its body and provider; for a body read
    from an envelope, the envelope (`record`) and the key holding the body (`key`), so that
    `fix` writes the envelope back with only its body rewritten."""

    source: str
    line: int
    body: dict[str, Any]
    provider: Provider
    record: dict[str, Any] | None = None
    key: str | None = None

    def with_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The log record with `body` in place of this request's body: `body` itself, or a
        copy of the envelope (its other fields and key order kept) holding `body`."""
        if self.record is None or self.key is None:
            return body
        return {**self.record, self.key: body}


def load_requests(paths: list[str], provider: str | None = None,
                  skip: str | None = None, skipped: list[Skipped] | None = None
                  ) -> list[LoadedRequest]:
    """All requests in `paths` ("-" is stdin), in order, validated. `skip`: a file that a
    directory's walk leaves out (the command's own output: a report or fixed log written
    into the log directory was read back as input by the next run). `skipped`: a lenient
    load, which leaves bad records out and notes each in this list (None: the first one
    refuses the whole input)."""
    if provider is not None and provider not in PROVIDERS:
        raise InputError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    out: list[LoadedRequest] = []
    own = Path(skip).resolve() if skip is not None and skip != "-" else None
    texts = [text for path in paths for text in _texts(path, own, skipped)]
    for source, text in texts:
        for line, record in _records(source, text, skipped):
            try:
                out.append(_request(source, line, record, provider))
            except InputError as exc:
                _skip(skipped, source, line, exc)
    if skipped:  # in the order of the input (a file's lines not UTF-8 were noted first)
        rank = {source: n for n, (source, _) in enumerate(texts)}
        skipped.sort(key=lambda k: (rank[k.source], k.line))
    if not out:
        raise InputError(f"no requests found in {', '.join(paths)}")
    return out


def _texts(path: str, own: Path | None = None, skipped: list[Skipped] | None = None
           ) -> list[tuple[str, str]]:
    if path == "-":
        return [("<stdin>", _read_stdin(skipped))]
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if _is_log_name(f.name) and f.is_file()
                       and (own is None or f.resolve() != own))
        return [(str(f), _read(f, skipped)) for f in files]
    if not p.exists():
        raise InputError(f"{path}: no such file or directory")
    return [(path, _read(p, skipped))]


#: What a directory's walk reads: JSON and JSONL files, gzipped or not.
LOG_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
#: The first bytes of a gzip stream.
GZIP_MAGIC = b"\x1f\x8b"


def _is_log_name(name: str) -> bool:
    return name.endswith(LOG_SUFFIXES)


def _gunzip(source: str, raw: bytes) -> bytes:
    """`raw` decompressed when it is a gzip stream (a rotated log, `log.jsonl.gz`: it was
    refused as "not UTF-8: byte 0x8b"), else `raw` itself; an InputError for a damaged or cut
    gzip stream."""
    if not raw.startswith(GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"{source}: cannot read: not a whole gzip stream ({exc})") from None


def _read_stdin(skipped: list[Skipped] | None = None) -> str:
    """stdin's text; an InputError when it cannot be read (started with its descriptor
    closed, `<&-`: an AttributeError traceback and exit 1 before)."""
    if sys.stdin is None:
        raise InputError("<stdin>: cannot read: stdin is closed")
    stdin = getattr(sys.stdin, "buffer", None)  # None where stdin was replaced by text
    try:
        raw = sys.stdin.read() if stdin is None else stdin.read()
    except OSError as exc:
        raise InputError(f"<stdin>: cannot read: {exc.strerror or exc}") from None
    if isinstance(raw, str):
        return raw.removeprefix(BOM)
    return _decode("<stdin>", _gunzip("<stdin>", raw), skipped)


def _read(path: Path, skipped: list[Skipped] | None = None) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return _decode(str(path), _gunzip(str(path), raw), skipped)


def _decode(source: str, raw: bytes, skipped: list[Skipped] | None = None) -> str:
    """`raw` as UTF-8 text without a leading byte order mark (which editors and shells on
    Windows write, and which JSON parsers may ignore: it refused the whole file as "invalid
    JSON: Unexpected UTF-8 BOM"); else an InputError at the line and column of the first
    byte that is not UTF-8 (as for a line that is not JSON: the whole input is refused)."""
    try:
        return raw.decode("utf-8").removeprefix(BOM)
    except UnicodeDecodeError as exc:
        if skipped is None:
            raise _not_utf8(source, raw, exc) from None
    return "\n".join(_utf8_lines(source, raw, skipped)).removeprefix(BOM)


def _not_utf8(source: str, raw: bytes, exc: UnicodeDecodeError) -> InputError:
    """The error for `raw`'s first byte that is not UTF-8, at its line and column."""
    line = raw.count(b"\n", 0, exc.start) + 1
    start = raw.rfind(b"\n", 0, exc.start) + 1
    column = len(raw[start:exc.start].decode("utf-8", "replace")) + 1
    return InputError(f"{source}:{line}: not UTF-8: byte 0x{raw[exc.start]:02x} "
                      f"(column {column})")


def _utf8_lines(source: str, raw: bytes, skipped: list[Skipped]) -> list[str]:
    """`raw`'s lines as text for a lenient load: a line that is not UTF-8 is noted in
    `skipped` and left empty (so every other line keeps its number)."""
    lines: list[str] = []
    for n, data in enumerate(raw.split(b"\n"), start=1):
        try:
            lines.append(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            where = f"{source}:{n}"
            _skip(skipped, source, n, InputError(
                f"{where}: not UTF-8: byte 0x{data[exc.start]:02x} (column "
                f"{len(data[:exc.start].decode('utf-8', 'replace')) + 1})"))
            lines.append("")
    return lines


def _records(source: str, text: str, skipped: list[Skipped] | None = None
             ) -> list[tuple[int, Any]]:
    stripped = text.strip()
    if not stripped:
        return []
    if stripped[0] in "[{":
        records = _document(source, text, stripped, skipped)
        if records is not None:
            return records
    out = []
    # JSONL lines end at "\n" only: str.splitlines() also cut at U+2028, U+2029 and U+0085,
    # which JSON strings may hold raw (a log written with ensure_ascii=False, as `fix` writes)
    for n, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                out.append((n, _parse(f"{source}:{n}", line)))
            except InputError as exc:
                _skip(skipped, source, n, exc)
    return out


def _document(source: str, text: str, stripped: str, skipped: list[Skipped] | None = None
              ) -> list[tuple[int, Any]] | None:
    """The input as one JSON document, as (line, record) pairs: the object, or each record
    of an array at the line where it starts (all were line 1 before: a SARIF result or an
    error pointed at the top of a pretty-printed file), each checked like a line (a lenient
    load leaves out the records that fail); None when it is not one document (JSONL; for a
    lenient load also one whose first value fails, so that its lines are judged one by one)."""
    lead = len(text) - len(text.lstrip())
    first = text.count("\n", 0, lead) + 1
    where = f"{source}:{first}"
    try:
        whole = _loads(stripped)
    except json.JSONDecodeError:
        return None
    except (RecursionError, ValueError) as exc:  # too deep, or a number that is not JSON
        if skipped is not None:
            return None
        problem = f"JSON nested deeper than {MAX_DEPTH} levels" \
            if isinstance(exc, RecursionError) else f"invalid JSON: {exc}"
        raise InputError(f"{where}: {problem}") from None
    records = list(zip(_element_lines(text, lead, len(whole)), whole, strict=True)) \
        if isinstance(whole, list) else [(first, whole)]
    strings = _SURROGATE_ESCAPE.search(stripped) is not None
    kept = []
    for line, record in records:
        try:
            _check_value(f"{source}:{line}", record, strings)
            kept.append((line, record))
        except InputError as exc:
            _skip(skipped, source, line, exc)
    return kept


def _element_lines(text: str, at: int, count: int) -> list[int]:
    """The line on which each of the `count` elements of the JSON array starting at `text[at]`
    starts (the array has been parsed already, so each element decodes)."""
    decoder = json.JSONDecoder()
    lines: list[int] = []
    line, seen = 1, 0
    at += 1  # past "["
    for _ in range(count):
        at = _skip_space(text, at)
        line += text.count("\n", seen, at)
        seen = at
        lines.append(line)
        at = _skip_space(text, decoder.raw_decode(text, at)[1]) + 1  # past "," (or "]")
    return lines


def _skip_space(text: str, at: int) -> int:
    """The offset of the first character at or after `at` that is not JSON whitespace."""
    found = _SPACE.match(text, at)
    return at if found is None else found.end()


def _parse(where: str, line: str) -> Any:
    """One JSONL line, checked (`_check_value`); `where` is its file:line."""
    try:
        value = _loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from exc
    except RecursionError:
        raise InputError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # NaN, 1e400, an integer of thousands of digits
        raise InputError(f"{where}: invalid JSON: {exc}") from None
    if line.count("[") + line.count("{") > MAX_DEPTH or _SURROGATE_ESCAPE.search(line):
        _check_value(where, value, True)
    return value


def _check_value(where: str, value: Any, strings: bool) -> None:
    """Refuse a record nested deeper than `MAX_DEPTH` or (with `strings`: its text held a
    surrogate escape) one whose keys or strings hold a lone surrogate. Walks one nesting
    level at a time, without recursion."""
    level, depth = [value], 0
    while level:
        deeper: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                deeper += node.keys()
                deeper += node.values()
            elif isinstance(node, list):
                deeper += node
            elif strings and isinstance(node, str) and (found := _SURROGATE.search(node)):
                near = node[max(found.start() - 20, 0):found.end() + 20]
                raise InputError(f"{where}: lone UTF-16 surrogate escape in a string, "
                                 f"{ascii(near)} (not Unicode)")
        if deeper and (depth := depth + 1) > MAX_DEPTH:
            raise InputError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
        level = deeper


def _request(source: str, line: int, record: Any, provider: str | None) -> LoadedRequest:
    body, envelope, key = record, None, None
    if isinstance(record, dict) and "messages" not in record:
        for name in ("body", "request"):
            if isinstance(record.get(name), dict):
                body, envelope, key = record[name], record, name
                break
    try:
        if isinstance(body, dict) and "messages" not in body:
            raise RequestError(_not_a_request(body))
        prov = cast(Provider, provider) if provider is not None else detect_provider(body)
        validate(body, prov)
        if prov == "openai" and isinstance(body, dict) and "system" in body:
            raise RequestError("a top-level 'system' is an Anthropic request's (Chat "
                               "Completions has none): not an OpenAI request")
    except RequestError as exc:
        raise InputError(f"{source}:{line}: {exc}") from exc
    return LoadedRequest(source, line, body, prov, envelope, key)


#: Top-level keys of a record named in the error for one that holds no request.
KEYS_SHOWN = 8


def _not_a_request(record: dict[str, Any]) -> str:
    """The problem with a record that has no `messages`: what is read, and the record's keys,
    so that a log of another format (a Responses API request, an OpenTelemetry span, a
    LangSmith run) says so (it was "'messages' must be a non-empty list")."""
    keys = [ascii(k)[1:-1] for k in list(record)[:KEYS_SHOWN]]
    more = ", ..." if len(record) > KEYS_SHOWN else ""
    return ("no 'messages': not an OpenAI Chat Completions or Anthropic Messages request body, "
            "nor an envelope holding one under 'request' or 'body' (its keys: "
            f"{', '.join(keys) or 'none'}{more})")
