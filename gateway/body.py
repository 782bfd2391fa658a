"""Request bodies in: bounded JSON that can never become a 5xx.

`parse_body` turns raw bytes into a JSON object or a 400 (`GatewayError`) that the route renders
in its caller's format: invalid JSON, nesting deeper than `max_depth` (the C parser's recursion
guard, or a shallower configured bound), integers with more digits than Python converts, and any
integer or float outside what a sampling field can mean (|n| >= 2**63, non-finite numbers), and
a lone UTF-16 surrogate escape (`"\ud800"`: no encoder, database or upstream accepts it; a valid
escaped pair such as an emoji is fine).
`cap_max_tokens` clamps a body's token limits to the server's cap before it is parsed.
`INLINE_BYTES` is the size past which JSON work on a body (parsing a client's, serialising an
upstream's) runs in a worker thread, off the event loop; `text_chars` estimates it cheaply.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.errors import invalid

MAX_INT = 2**63
INLINE_BYTES = 64 << 10  # bodies above this are parsed / serialised in a worker thread
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # \ud800..\udfff in JSON text


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes, max_depth: int = 64) -> dict[str, Any]:
    """The body as a JSON object within `max_depth` levels, or a 400 naming the body.
    orjson parses (it refuses NaN/Infinity and lone surrogates, as the checks below do, and
    makes an integer past 64 bits a float, which the range check refuses); what it refuses is
    parsed again by the standard library, whose error says what is wrong, and only such a body
    is searched for a lone surrogate escape."""
    try:
        data = orjson.loads(raw)
        strings = False  # orjson refuses a lone surrogate escape itself
    except orjson.JSONDecodeError:
        data = _parse_strict(raw, max_depth)
        strings = _SURROGATE_ESCAPE.search(raw) is not None
    if not isinstance(data, dict):
        raise invalid("request body must be a JSON object", "body")
    check_shape(data, max_depth, strings=strings)
    return data


def _parse_strict(raw: bytes, max_depth: int) -> Any:
    """The standard library's parse, for the error message of a body orjson refused."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise invalid(f"request body is nested deeper than {max_depth} levels", "body") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, too-long integers
        raise invalid(f"request body is not valid JSON: {exc}", "body") from None


def check_shape(data: Any, max_depth: int, *, strings: bool = False) -> None:
    """Walk `data` one nesting level at a time, without recursion: depth bound and number
    range (and with `strings`, no lone surrogate in any key or string), else a 400. Values
    are told apart by exact type (what a JSON parser makes), in one loop with no call per
    container: several times faster than an isinstance walk on a large body."""
    level: list[Any] = [(data,)]  # `data` in a container of its own, at depth 0
    depth = 0
    while level:
        if depth > max_depth:
            raise invalid(f"request body is nested deeper than {max_depth} levels", "body")
        deeper: list[Any] = []
        push = deeper.append
        for node in level:
            if type(node) is dict:
                if strings:
                    _check_texts(node)
                node = node.values()
            for child in node:
                kind = type(child)
                if kind is str:
                    if strings:
                        _check_text(child)
                elif kind is dict or kind is list:
                    push(child)
                elif kind is int:
                    if not -MAX_INT <= child < MAX_INT:
                        raise invalid("request body has an integer outside the 64-bit range",
                                      "body")
                elif kind is float:
                    _check_number(child)
        level = deeper
        depth += 1


def _check_texts(values: Any) -> None:
    for value in values:
        _check_text(value)


def _check_text(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("request body has a lone UTF-16 surrogate in a string", "body") from None


def _check_number(value: Any) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -MAX_INT <= value < MAX_INT:
        raise invalid("request body has an integer outside the 64-bit range", "body")
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid("request body has a number outside the float range", "body")
    # orjson parses an integer past 64 bits as a float: -2**63 - 1 becomes -2.0**63, so that
    # bound is open on both sides for a float
    if isinstance(value, float) and not -MAX_INT < value < MAX_INT:
        raise invalid("request body has a number outside the 64-bit range", "body")


def cap_max_tokens(body: dict[str, Any], cap: int) -> dict[str, Any]:
    """`body` with `max_tokens` / `max_completion_tokens` / `max_output_tokens` (Responses)
    clamped to `cap` (a copy when any changes; other values, wrong types included, are left
    for the parser to judge)."""
    over = [name for name in TOKEN_FIELDS
            if type(body.get(name)) is int and body[name] > cap]
    if not over:
        return body
    return {**body, **{name: cap for name in over}}


def text_chars(messages: Sequence[Mapping[str, Any]], prompt: str | None = None) -> int:
    """Characters of the message contents (strings, text blocks, and the inline data or URL of
    images, audio and files) and of `prompt`: a cheap lower bound of a body's JSON size, to
    decide whether to serialise it off the loop."""
    total = len(prompt or "")
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(_part_chars(b) for b in content if isinstance(b, dict))
    return total


#: where a non-text part keeps its data: OpenAI's image_url, input_audio and file parts, an
#: Anthropic image's or document's source
_PART_DATA = (("image_url", "url"), ("input_audio", "data"), ("file", "file_data"),
              ("source", "data"))


def _part_chars(part: Mapping[str, Any]) -> int:
    """Characters of a part's text, or of its inline data (a base64 image is most of a body)."""
    text = part.get("text")
    if isinstance(text, str):
        return len(text)
    for key, field in _PART_DATA:
        inner = part.get(key)
        if isinstance(inner, dict) and isinstance(inner.get(field), str):
            return len(inner[field])
    return 0


def media_chars(messages: Sequence[Any]) -> int:
    """Characters of the inline data (or URL) of the non-text parts of a client's `messages`,
    those inside an Anthropic tool_result included."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            total += sum(_media_chars(b) for b in content if isinstance(b, dict))
    return total


def _media_chars(part: Mapping[str, Any]) -> int:
    if isinstance(part.get("text"), str):
        return 0
    inner = part.get("content")
    if isinstance(inner, list):  # a tool_result's blocks
        return sum(_media_chars(b) for b in inner if isinstance(b, dict))
    return _part_chars(part)
