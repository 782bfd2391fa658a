"""Is this text, so far, the start of one JSON value? Checked a piece at a time.

A streamed tool call's arguments reach an Anthropic client as `input_json_delta` fragments,
and its SDK parses the fragments so far as partial JSON after each one, raising (and ending
the client's stream) at the first that is no JSON prefix. An upstream model can write invalid
arguments; the Messages route passes a call's fragments only while they stay a JSON prefix.
"""

from __future__ import annotations

import re

_CLOSERS = {"}": "{", "]": "["}
_WORD_CHARS = frozenset("0123456789+-.eEtrufalsn")
_LITERALS = ("true", "false", "null")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NUMBER_START = re.compile(r"-|-?(0|[1-9]\d*)(\.\d*)?([eE][+-]?\d*)?")
_ESCAPES = frozenset('"\\/bfnrtu')


class JsonPrefix:
    """Feeds text a piece at a time; `ok` stays True while all of it is the start of one JSON
    value (a value cut anywhere, even inside a string, a number or a literal, is a prefix)."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers, "{" or "["
        # what may come next: value, value_or_close, key, key_or_close, colon, after
        self.expect = "value"
        self.in_string = False
        self.escape = False
        self.is_key = False
        self.word = ""  # a number or literal being read
        self.ok = True
        self.started = False  # something but whitespace was fed

    def feed(self, text: str) -> bool:
        """Take `text`; True while everything fed so far is a JSON prefix."""
        for ch in text:
            if not self.ok:
                break
            self.ok = self._char(ch)
        self.started = self.started or bool(text.strip())
        return self.ok

    def _char(self, ch: str) -> bool:
        if self.in_string:
            return self._string_char(ch)
        if self.word:
            if ch in _WORD_CHARS:
                self.word += ch
                return self._word_may_grow()
            if not self._word_done():
                return False
        if ch in " \t\r\n":
            return True
        if self.expect in ("value", "value_or_close"):
            return self._value_start(ch)
        if self.expect in ("key", "key_or_close"):
            if self.expect == "key_or_close" and ch == "}":
                return self._close(ch)
            self.in_string = self.is_key = ch == '"'
            return self.in_string
        if self.expect == "colon":
            self.expect = "value"
            return ch == ":"
        return self._after_value(ch)

    def _string_char(self, ch: str) -> bool:
        if self.escape:
            self.escape = False
            return ch in _ESCAPES
        if ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            self.expect = "colon" if self.is_key else "after"
        elif ch < " ":  # control characters are escaped in JSON strings
            return False
        return True

    def _value_start(self, ch: str) -> bool:
        if ch == "]" and self.expect == "value_or_close":
            return self._close(ch)
        if ch in "{[":
            self.stack.append(ch)
            self.expect = "key_or_close" if ch == "{" else "value_or_close"
        elif ch == '"':
            self.in_string, self.is_key = True, False
        elif ch in "-0123456789tfn":
            self.word = ch
        else:
            return False
        return True

    def _after_value(self, ch: str) -> bool:
        if not self.stack:  # one value only
            return False
        if ch == ",":
            self.expect = "key" if self.stack[-1] == "{" else "value"
            return True
        return ch in _CLOSERS and self._close(ch)

    def _close(self, ch: str) -> bool:
        if not self.stack or self.stack.pop() != _CLOSERS[ch]:
            return False
        self.expect = "after"
        return True

    def _word_may_grow(self) -> bool:
        """A literal still on its way to true/false/null, or a number's characters."""
        if self.word[0] in "tfn":
            return any(lit.startswith(self.word) for lit in _LITERALS)
        return _NUMBER_START.fullmatch(self.word) is not None

    def _word_done(self) -> bool:
        """The word ended (a delimiter came): it must be a whole literal or number."""
        word, self.word, self.expect = self.word, "", "after"
        return word in _LITERALS or _NUMBER.fullmatch(word) is not None
