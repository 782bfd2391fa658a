"""Streaming tool calls: model text in, visible text and `ToolCallDelta` pieces out.

A call block is `<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>` (the convention of
`gateway.tool_calls`; the embedded engine's grammar fixes `name` before `arguments`). The stream
emits the call's id and name as soon as `"arguments":` has been read, then the text of ARGS as
it arrives, the way OpenAI streams `delta.tool_calls[].function.arguments` and Anthropic
streams `input_json_delta`. Visible text is what precedes the first call, as in
`parse_output`; the `Final` still carries the whole calls parsed from the full text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

from gateway.tool_calls import CLOSE, OPEN, ParsedOutput, ToolCallFilter, call_id, parse_output
from gateway.types import ToolCallDelta

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
State = Literal["text", "head", "args", "tail", "between"]


@dataclass
class ArgumentScanner:
    """Finds where a JSON value ends in text fed piece by piece (strings and escapes aware)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def take(self, text: str) -> tuple[str, str | None]:
        """(the part of `text` inside the value, the rest after it or None if not ended)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = self.started = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]" or (ch == "," and self.depth == 0):
                if self.depth == 0:
                    return text[:i], text[i:]
                self.depth -= 1
                if self.depth == 0:
                    return text[: i + 1], text[i + 1 :]
            elif not ch.isspace():
                self.started = True
        return text, None


@dataclass
class ToolCallStream:
    """Splits a streamed output into visible text and tool-call pieces."""

    request_id: str
    state: State = "text"
    index: int = 0
    buffer: str = ""
    text_filter: ToolCallFilter = field(default_factory=ToolCallFilter)
    scanner: ArgumentScanner = field(default_factory=ArgumentScanner)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(visible text safe to send now, tool-call pieces) for the next piece of output."""
        if self.state == "text":
            visible = self.text_filter.feed(text)
            if not self.text_filter.in_call:
                return visible, []
            self.state, text = "head", self.text_filter.held[len(OPEN) :]
            return visible, self._calls(text)
        return "", self._calls(text)

    def _calls(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        rest: str | None = text
        while rest:
            rest = getattr(self, f"_in_{self.state}")(rest, out)
        return out

    def _in_head(self, text: str, out: list[ToolCallDelta]) -> str | None:
        self.buffer += text
        match = _HEAD.match(self.buffer)
        if match is None:
            return None
        name = json.loads(f'"{match.group(1)}"')
        out.append(ToolCallDelta(self.index, "", call_id(self.request_id, self.index), name))
        rest, self.buffer, self.state = self.buffer[match.end() :], "", "args"
        self.scanner = ArgumentScanner()
        return rest

    def _in_args(self, text: str, out: list[ToolCallDelta]) -> str | None:
        if not self.scanner.started:  # the whitespace before the value is not part of it
            text = text.lstrip()
            if not text:
                return None
        inside, rest = self.scanner.take(text)
        if inside:
            out.append(ToolCallDelta(self.index, inside))
        if rest is not None:
            self.state = "tail"
        return rest

    def _in_tail(self, text: str, out: list[ToolCallDelta]) -> str | None:
        self.buffer += text
        end = self.buffer.find(CLOSE)
        if end < 0:
            return None
        rest, self.buffer = self.buffer[end + len(CLOSE) :], ""
        self.index, self.state = self.index + 1, "between"
        return rest

    def _in_between(self, text: str, out: list[ToolCallDelta]) -> str | None:
        self.buffer += text
        start = self.buffer.find(OPEN)
        if start < 0:
            return None
        rest, self.buffer, self.state = self.buffer[start + len(OPEN) :], "", "head"
        return rest

    def finish(self, full_text: str, cut: bool = False) -> tuple[str, ParsedOutput]:
        """(visible text not yet sent, the whole output parsed into text and calls; `cut`: the
        output ended at max_tokens)."""
        return self.text_filter.finish(full_text, self.request_id, cut)


def streamed_calls(pieces: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """(name, arguments text) per call, reassembled from pieces (for tests and clients)."""
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for piece in pieces:
        calls.setdefault(piece.index, []).append(piece.arguments)
        if piece.name is not None:
            names[piece.index] = piece.name
    return [(names.get(i, ""), "".join(calls[i])) for i in sorted(calls)]


__all__ = ["ArgumentScanner", "ToolCallStream", "parse_output", "streamed_calls"]
